"""The suite's time budget, printed at the end of every run (``make test``, ``make check``).

A test suite gets slow one test at a time, and nobody notices a test that took 40 s when the run
as a whole is green. So every run ends with a "time budget" section: the wall time and the
test-seconds (setup + call + teardown, summed over workers), and every test over
``SLOW_SECONDS`` that is not in :data:`BUDGETS`, or that took more than twice its budget there.
A reviewer sees a new slow test in the output of the change that added it. The section never
fails a run: a loaded machine makes every test slower, and CI must not go red on a busy box.

:data:`BUDGETS` is the list of tests allowed to take longer, each with the seconds it took on a
quiet 2-core VM (docs/TESTING.md says why each needs a process of its own). A test's budget is
checked against its setup + call + teardown, so a fixture that got slow shows up too.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

SLOW_SECONDS = 8.0
"""A test above this (setup + call + teardown) needs a line in BUDGETS."""

BUDGETS: dict[str, float] = {
    # the programs users run, each a process (or several) that imports torch and often transformers
    "tests/test_bench_smoke.py::test_group_benchmark_times_every_peer_shape": 18,  # torchrun, 3 times
    "tests/test_bench_smoke.py::test_hooks_benchmark_times_hooked_and_plain_steps": 9,
    "tests/test_bench_smoke.py::test_workdirs_benchmark_times_a_start_with_and_without_the_overlay": 10,  # torch, twice
    "tests/test_bench_smoke.py::test_round_benchmark_runs_and_writes_every_row": 9,
    "tests/test_bench_smoke.py::test_unequal_benchmark_runs_every_policy": 17,  # 3 hubs, 6 peers (forked)
    # root only: namespaces, 2 peers, today's hub and a --store hub, SeaweedFS in its namespace (~4 s)
    "tests/test_bench_smoke.py::test_wire_benchmark_shapes_links_and_leaves_no_namespace": 11,
    # root only: namespaces; a hub and 2 peers four times (fixed, auto, a drop, one killed), 3 s lease
    # (issues 40 and 46; 19 s at load 3-5)
    "tests/test_bench_smoke.py::test_utilization_benchmark_measures_every_interval_and_a_killed_peer": 22,
    # root only: the reference job serial, 2 peers twice (per-device, equal batch) in namespaces through a
    # hub, serial again, then 4 scoring processes (issue 45; 35 s alone, load 1-3; 75 s beside chaos's)
    "tests/test_bench_smoke.py::test_ttq_benchmark_times_serial_and_peers_to_serials_perplexity": 36,
    # issue 36: 3 peer processes (torch), a SIGKILL, its 1.5 s grace, a restart (18 s at load 14)
    "tests/test_bench_smoke.py::test_failures_benchmark_measures_a_sigkill_from_the_hubs_records": 10,
    "tests/test_bench_smoke.py::test_failures_benchmark_cuts_a_link_and_leaves_no_namespace": 9,  # root; a 3 s lease
    # 3 processes of the reference job (transformers, datasets), one SIGKILLed and restarted (60 s at load 14)
    "tests/test_bench_smoke.py::test_chaos_benchmark_preempts_and_restarts_a_reference_job_peer": 30,
    "tests/test_finetune.py::test_a_samples_run_trains_until_the_run_has_seen_its_epochs": 33,
    # issue 44: the serial baseline after the peers (+1 process, ~7 s), one plot instead of three (-1 s);
    # estimated from those parts, not timed on a quiet VM
    "tests/test_finetune.py::test_two_local_peers_end_identical_and_learn": 22,
    "tests/test_local.py::test_a_failed_peer_stops_the_others_and_the_hub": 12,
    "tests/test_local.py::test_sdk_peers_print_a_row_per_round": 9,  # + the launcher's plot: matplotlib, ~1.3 CPU-s
    # 12 MB objects in SeaweedFS: two rounds' updates, results and versions
    "tests/test_reducer_parts.py::test_leases_written_as_parts_give_the_bits_of_the_hub_alone": 9,
    # two hubs, 3 peers, two runs; far reducers (own processes) against SeaweedFS
    "tests/test_reducer_parts.py::test_three_peers_and_two_far_reducers_give_the_bits_of_a_hub_alone": 18,
    # a lease expiry and a hub SIGKILL + restart, against SeaweedFS
    "tests/test_reducer_parts.py::test_a_dead_reducer_s_part_is_sent_again_a_dead_hub_s_aborted": 18,
    # two hubs, three reducer processes (one SIGKILLed through a fault proxy) and a lease's expiry
    "tests/test_reducers.py::test_a_reducer_killed_mid_lease_loses_it_and_another_redoes_it": 17,
    # two store hubs with a reducer each way, then the lies through both
    "tests/test_check_leases.py::test_lies_get_the_same_answers_from_reducers_and_the_hub_reads_no_body": 16,
    "tests/test_check_leases.py::test_a_round_checked_and_merged_by_reducers_is_bit_identical": 12,
    "tests/test_check_leases.py::test_a_reducer_killed_holding_a_check_lease_loses_it_and_the_peer_is_acknowledged": 12,
    "tests/test_reducers.py::test_a_hub_killed_while_its_leases_wait_closes_the_round_again_after_a_restart": 15,
    # issue 39: two hubs, three peers one after the other, a SIGKILL and a restart mid-fold, a reducer process
    "tests/test_reducers.py::test_a_hub_killed_mid_fold_loses_no_acknowledged_update_and_gives_the_same_bits": 15,
    "tests/test_reducers.py::test_with_no_reducer_left_the_hub_works_the_leases_itself": 10,
    "tests/test_reducers.py::test_reducer_processes_give_the_bits_of_the_hub_alone": 12,
    # three peers one after the other, two of them folded ahead (issue 39)
    "tests/test_reducers.py::test_reducers_merge_updates_that_peers_uploaded_to_the_bucket": 14,
    "tests/test_zero_code.py::test_hugging_face_trainer_example": 11,
    "tests/test_zero_code.py::test_lightning_example": 12,  # import lightning: ~4 CPU-s a peer
    "tests/test_zero_code.py::test_plain_loop_example": 10,
    # weightsync-run --local-peers 2: its own hub and two torch peers (4.7 s alone; 10-14 s in a whole
    # run, beside the heaviest tests); two VMs, `python -m` and a console script (merged scenarios)
    "tests/test_zero_code.py::test_a_plain_loop_steps_at_the_scaled_rate_and_keeps_its_own": 10,
    "tests/test_zero_code.py::test_a_peer_that_finishes_first_leaves_without_holding_the_other_back": 8,
    # two transformers processes, the second a Trainer (subclass): the Trainer-subclass test is merged in;
    # 7 steps, 5 rounds, both save (issue 37)
    "tests/test_zero_code.py::test_two_machines_a_plain_loop_and_a_trainer_end_on_the_hubs_last_version": 14,
    # issue 37, what a script saves (docs/TESTING.md, merged scenarios): two --local-peers 2 launches
    # side by side (4 torch peers, 2 hubs); two VMs, one of them Lightning (~4 CPU-s to import)
    "tests/test_zero_code.py::test_a_plain_loop_saves_the_runs_model_whichever_way_it_saves": 9,
    "tests/test_zero_code.py::test_two_machines_a_plain_loop_and_a_lightning_run_save_the_hubs_last_version": 12,
    "tests/test_hooks.py::test_a_loop_that_steps_by_hand_syncs_as_one_with_an_optimizer": 14,  # 3 programs side by side
    # issue 48: public scripts verbatim (tests/public), each 2 peers beside a hub; timed alone at load 6-8 on
    # the shared 2-core VM, on the code of d1ff949, where nanoGPT and the word LM stop early (their full runs
    # take longer); run_clm's peers import transformers, datasets and evaluate (~10 CPU-s each)
    "tests/test_public_scripts.py::test_nanogpt_shakespeare_char": 22,
    "tests/test_public_scripts.py::test_transformers_run_clm": 52,
    "tests/test_public_scripts.py::test_pytorch_examples_word_language_model": 25,
    # torchrun groups: three peer shapes in one run (9 processes that import torch, 6 of them
    # transformers); a killed rank (two peers, 6 processes); a hub gone for good (3 processes and
    # 0.5 s of the SDK's retries). Alone, on a shared 2-core VM (load 5), 2026-11-27: 25, 15, 10 s
    "tests/test_group.py::test_a_group_follows_the_intervals_the_hub_picks": 12,  # torchrun, one peer of two ranks
    "tests/test_group.py::test_a_hub_gone_for_good_stops_every_rank_of_the_group": 10,
    "tests/test_group.py::test_a_killed_rank_takes_its_group_out_and_the_other_peer_carries_on": 15,
    "tests/test_group.py::test_every_rank_of_every_peer_holds_the_hubs_version": 25,
    # SIGKILLs; the SDK's retry back-off through 7 resets; a 3 s deadline and the 1 s, 2 s back-off
    # that the storage-fault test must see grow
    "tests/test_crash.py::test_hub_killed_at_random_points_of_a_multi_round_run": 24,
    "tests/test_faults.py::test_peers_killed_mid_upload_and_mid_training": 10,
    "tests/test_faults.py::test_reset_on_connect": 11,
    "tests/test_faults.py::test_storage_fault_gives_503_and_never_a_half_written_version": 8,
    # 3 rounds x 8 racing attempts at a 17 MiB update against a real hub: 8.4 s on a shared 2-core VM
    "tests/test_resume.py::test_a_peer_racing_its_own_retries_is_acknowledged_once": 8,
    # the object store (SYNC_STORE): two hubs (with and without a store) and `syncserver status`;
    # a download slowed to 500 kB/s so that its 2 s URL expires before the resume
    "tests/test_store_wire.py::test_two_peers_three_rounds_through_the_store": 10,
    "tests/test_store_wire.py::test_cut_download_resumes_against_the_bucket_and_an_expired_url_asks_the_hub_again": 12,
    "tests/test_store_wire.py::test_hub_killed_between_a_results_upload_and_its_commit": 11,  # two hubs, a restart
    "tests/test_store_wire.py::test_store_bytes_benchmark_runs": 11,  # bench/storebytes.py: 3 hubs, 2 peers, 1 reducer
    # updates through the store: 8 lies, each a presign, a part and a report; a URL left to
    # expire (3 s); a hub killed twice; part PUTs cut for the SDK's 2 s of retries; two hubs
    "tests/test_store_uploads.py::test_each_lie_is_refused_with_its_reason_and_nothing_recorded": 12,
    "tests/test_store_uploads.py::test_a_url_for_another_key_or_expired_is_refused": 9,
    "tests/test_store_uploads.py::test_hub_killed_between_upload_and_record_deletes_the_orphan": 14,
    "tests/test_store_uploads.py::test_store_failing_mid_upload_falls_back_to_the_hub": 9,
    "tests/test_store_uploads.py::test_int8_with_the_norm_guard_through_the_store_is_bit_identical": 9,
    # issue 36: peer processes SIGKILLed (twice, a restart between) and SIGSTOPped, each round of a
    # real hub; bench/lease.py's hub and torch peer. On a shared, loaded 2-core VM: 12, 9, 10 s
    "tests/test_peer_failures.py::test_a_sigkilled_peer_costs_the_survivors_seconds_and_comes_back": 12,
    "tests/test_peer_failures.py::test_a_hung_peer_is_gone_at_its_lease_and_the_merge_floor_waits_for_it": 10,
    "tests/test_bench_smoke.py::test_lease_benchmark_measures_a_peer_s_lease_age": 10,
    # a hub SIGKILLed twice under async rounds
    "tests/test_policies.py::test_async_survives_sigkills_of_the_hub": 12,
    "tests/test_objectstore.py::test_store_benchmark_runs": 9,  # bench/store.py --quick: our client, 16 MB
    # attacks and fuzzing, bounded: 4 clients on a 100k-tensor run; ~1,600 generated requests (EXAMPLES 20:
    # 49 -> 29 s back to back against 50, at load 1.6)
    "tests/test_cost.py::test_a_run_of_100k_tensors_polled_by_4_clients_starves_no_other_run": 14,
    "tests/test_schemathesis.py::test_api_fuzz_no_server_error_and_schema_conformance": 28,
}
"""nodeid (without parameters) -> seconds, measured in a whole run on a quiet 2-core VM (two
workers, coverage on: 2026-11-26). The benchmarks' smoke tests, and test_zero_code's and
test_faults' tests, made cheaper since (2026-11-27): their budget times the ratio of their seconds
after to before, measured back to back, and never less than the seconds measured after."""

_seconds: defaultdict[str, float] = defaultdict(float)
_started = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # on the xdist controller too: each worker's reports come back through this hook
    _seconds[report.nodeid] += report.duration


def _budget(nodeid: str) -> float | None:
    return BUDGETS.get(nodeid, BUDGETS.get(nodeid.split("[", 1)[0]))


def over_budget(seconds: dict[str, float]) -> list[tuple[str, float, float | None]]:
    """(nodeid, seconds, budget or None) for each test over its budget, slowest first."""
    rows = []
    for nodeid, took in seconds.items():
        budget = _budget(nodeid)
        if (budget is None and took > SLOW_SECONDS) or (budget is not None and took > 2 * budget):
            rows.append((nodeid, took, budget))
    return sorted(rows, key=lambda row: -row[1])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _seconds or hasattr(terminalreporter.config, "workerinput"):
        return
    write = terminalreporter.write_line
    terminalreporter.section("time budget")
    total = sum(_seconds.values())
    write(f"{len(_seconds)} tests: {total:.0f} test-seconds in {time.monotonic() - _started:.0f} s of wall time")
    rows = over_budget(_seconds)
    for nodeid, took, budget in rows:
        if budget is None:
            write(f"SLOW {took:6.1f} s  {nodeid}  (over {SLOW_SECONDS:.0f} s and not in tests/budget.py BUDGETS)")
        else:
            write(f"SLOW {took:6.1f} s  {nodeid}  (more than twice its budget of {budget:.0f} s)")
    if not rows:
        write(f"every test within its budget (a test over {SLOW_SECONDS:.0f} s needs a line in tests/budget.py)")
