/* weightsync dashboard. Long-polls v1/dashboard (the hub answers when something changed) and
 * draws it with plain DOM and inline SVG: no framework, no CDN, no build step.
 *
 * Token: /?token=… is moved into sessionStorage (this tab only) and removed from the address
 * bar; without one, a 401 shows a form. Every data call sends Authorization: Bearer.
 */
"use strict";
(() => {
  const TOKEN_KEY = "weightsync.token";
  const WAIT = 15; // seconds the hub may hold a data request open
  const TIMELINE_ROUNDS = 8;
  const TABLE_ROUNDS = 20;
  const SVGNS = "http://www.w3.org/2000/svg";
  const PEER_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1", "#edc948", "#ff9da7", "#9c755f", "#7f7f7f"];
  const PHASES = [
    ["train", "training"],
    ["upload", "upload"],
    ["wait", "waiting for stragglers"],
    ["aggregate", "aggregation & commit (hub)"],
    ["download", "download"],
  ];
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  const $ = (id) => document.getElementById(id);

  // ---- tiny DOM helpers -------------------------------------------------------------------
  function build(el, attrs, children) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "text") el.textContent = v;
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else el.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined || c === false) continue;
      el.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return el;
  }
  const h = (tag, attrs, ...children) => build(document.createElement(tag), attrs, children);
  const s = (tag, attrs, ...children) => build(document.createElementNS(SVGNS, tag), attrs, children);
  const fill = (el, ...children) => { el.replaceChildren(); build(el, {}, children); };

  // ---- formatting --------------------------------------------------------------------------
  function fmtBytes(n) {
    if (!n) return "0 B";
    const units = ["B", "kB", "MB", "GB", "TB"];
    const i = Math.min(units.length - 1, Math.floor(Math.log10(n) / 3));
    return `${(n / 10 ** (3 * i)).toFixed(i && n / 10 ** (3 * i) < 100 ? 1 : 0)} ${units[i]}`;
  }
  function fmtSecs(x) {
    if (x === null || x === undefined || !isFinite(x)) return "–";
    if (x === 0) return "0 s";
    if (x < 0.01) return `${(x * 1000).toFixed(1)} ms`;
    if (x < 1) return `${(x * 1000).toFixed(0)} ms`;
    if (x < 10) return `${x.toFixed(2)} s`;
    if (x < 60) return `${x.toFixed(1)} s`;
    const m = Math.floor(x / 60);
    if (m < 60) return `${m} m ${String(Math.round(x % 60)).padStart(2, "0")} s`;
    return `${Math.floor(m / 60)} h ${String(m % 60).padStart(2, "0")} m`;
  }
  const fmtNum = (n) => Number(n).toLocaleString("en-US");
  function fmtVal(v) {
    if (v === null || v === undefined) return "–";
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
    return Number(v.toPrecision(4)).toString();
  }
  const fmtAgo = (x) => (x < 1 ? "just now" : `${fmtSecs(x)} ago`);

  // ---- state and the long poll ---------------------------------------------------------------
  const state = { token: sessionStorage.getItem(TOKEN_KEY), run: runFromHash(), since: null, data: null, at: 0, ctrl: null, polling: false };

  (function takeTokenFromUrl() {
    const params = new URLSearchParams(location.search);
    if (!params.has("token")) return;
    state.token = params.get("token");
    sessionStorage.setItem(TOKEN_KEY, state.token);
    params.delete("token"); // keep it out of the address bar, history and screenshots
    const rest = params.toString();
    history.replaceState(null, "", location.pathname + (rest ? `?${rest}` : "") + location.hash);
  })();

  function runFromHash() {
    const m = location.hash.match(/^#run=(.+)$/);
    return m ? decodeURIComponent(m[1]) : null;
  }
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  function setConn(kind, label) {
    const el = $("conn");
    el.dataset.state = kind;
    el.querySelector(".label").textContent = label;
  }

  async function poll() {
    if (state.polling) return;
    state.polling = true;
    try {
      for (;;) {
        const ctrl = new AbortController();
        state.ctrl = ctrl;
        const q = new URLSearchParams();
        if (state.run) q.set("run", state.run);
        if (state.since) { q.set("since", state.since); q.set("wait", String(WAIT)); }
        const started = Date.now();
        try {
          const headers = state.token ? { Authorization: `Bearer ${state.token}` } : {};
          const r = await fetch(`v1/dashboard?${q}`, { headers, signal: ctrl.signal, cache: "no-store" });
          if (r.status === 401) { showLogin(Boolean(state.token)); return; }
          if (!r.ok) throw new Error(`${r.status} ${(await r.text()).slice(0, 200)}`);
          const data = await r.json();
          setConn("live", "live");
          state.since = data.fingerprint;
          state.data = data;
          state.at = Date.now();
          render(data);
        } catch (err) {
          if (ctrl.signal.aborted) continue; // another run was picked: ask again at once
          setConn("retrying", "hub unreachable, retrying…");
          state.since = null;
          await sleep(2000);
          continue;
        }
        const spent = Date.now() - started;
        if (spent < 400) await sleep(400 - spent); // many changes in a row: at most ~2 renders a second
      }
    } finally {
      state.polling = false;
    }
  }

  function showLogin(refused) {
    for (const id of ["run", "empty"]) $(id).hidden = true;
    $("login").hidden = false;
    $("login-error").hidden = !refused;
    $("forget").hidden = true;
    setConn("token", "token needed");
    $("token").focus();
  }

  $("login-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.token = $("token").value.trim();
    sessionStorage.setItem(TOKEN_KEY, state.token);
    $("login").hidden = true;
    state.since = null;
    poll();
  });
  $("forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    location.reload();
  });
  window.addEventListener("hashchange", () => {
    state.run = runFromHash();
    state.since = null;
    if (state.ctrl) state.ctrl.abort();
  });
  let resizeTimer = 0;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => state.data && render(state.data), 150);
  });
  setInterval(tick, 1000);

  // ---- rendering -------------------------------------------------------------------------------
  function render(data) {
    $("forget").hidden = !state.token;
    renderRunsNav(data.runs);
    if (!data.runs.length) return showEmpty(emptyHub());
    if (!state.run || (!data.run && !data.runs.some((r) => r.run === state.run))) {
      if (state.run && data.runs.length) return showEmpty(unknownRun(state.run, data.runs));
      history.replaceState(null, "", `#run=${encodeURIComponent(data.runs[0].run)}`);
      state.run = data.runs[0].run;
      state.since = null; // ask again for the run's details
      return;
    }
    if (!data.run) return; // the run appeared between two answers: the next one has it
    $("empty").hidden = true;
    $("login").hidden = true;
    $("run").hidden = false;
    renderRun(data.run);
    renderReducers(data.reducers || [], data.now);
    document.title = `${data.run.run} · v${data.run.version} · weightsync`;
  }

  function renderRunsNav(runs) {
    fill($("runs"), runs.map((r) => h("button", {
      type: "button",
      "aria-current": r.run === state.run ? "true" : "false",
      title: `${r.run}: version ${r.version}, ${r.peers} live peer(s), codec ${r.codec}, outer ${r.outer}`,
      onclick: () => { location.hash = `run=${encodeURIComponent(r.run)}`; },
    }, r.run, h("span", { class: "muted" }, `v${r.version} · ${r.peers} live`))));
  }

  function showEmpty(content) {
    $("run").hidden = true;
    $("login").hidden = true;
    const el = $("empty");
    fill(el, content);
    el.hidden = false;
  }

  function hubUrl() {
    return location.origin + location.pathname.replace(/\/$/, "");
  }

  function emptyHub() {
    return [
      h("h2", {}, "No runs yet"),
      h("p", {}, "This hub is up and waiting. A run shows up here as soon as its first peer joins, for instance:"),
      h("pre", {}, `${state.token ? "import os\n" : ""}from syncclient import SyncClient\n\nclient = SyncClient("${hubUrl()}", run="my-run", peer="gpu-1"${state.token ? ', token=os.environ["SYNC_TOKEN"]' : ""})\nclient.join(model)\n...\nclient.sync(model, samples=n, metrics={"loss": loss})`),
      h("p", { class: "muted" }, "or run ", h("code", {}, `python train/finetune_gpt2.py --hub ${hubUrl()} --run my-run`), " on each peer. This page updates by itself."),
    ];
  }

  function unknownRun(name, runs) {
    return [
      h("h2", {}, `No run named “${name}” on this hub`),
      h("p", {}, "Pick one of its runs above, or ", h("a", { href: `#run=${encodeURIComponent(runs[0].run)}` }, `open ${runs[0].run}`), "."),
    ];
  }

  function peerColors(run) {
    const names = run.peers.map((p) => p.peer);
    for (const name of Object.keys(run.curves.peers)) if (!names.includes(name)) names.push(name);
    return new Map(names.map((n, i) => [n, PEER_COLORS[i % PEER_COLORS.length]]));
  }

  function latest(points) {
    return points && points.length ? points[points.length - 1][1] : null;
  }

  function renderRun(run) {
    const colors = peerColors(run);
    renderNotice(run);
    renderSummary(run);
    renderPeers(run, colors);
    renderOpen(run);
    renderTimeline(run, colors);
    renderCurves(run, colors);
    renderRounds(run);
  }

  // two peers trained on the same data: the hub says so once per run (core/samedata.py)
  function renderNotice(run) {
    const el = $("notice");
    const same = run.same_data;
    el.hidden = !same;
    if (!same) return el.replaceChildren();
    el.dataset.round = same.round;
    fill(el, h("b", {}, "Same data. "), same.message);
  }

  function stat(label, value, small) {
    return h("div", { class: "stat" }, h("div", { class: "k" }, label), h("div", { class: "v" }, value), h("div", { class: "sub" }, small || "\u00a0"));
  }

  function renderSummary(run) {
    const live = run.peers.filter((p) => p.state === "live" || p.state === "late").length;
    const last = run.rounds[run.rounds.length - 1];
    const rate = run.peers.filter((p) => p.state === "live").reduce((a, p) => a + p.samples_per_second, 0);
    const via = (b) => `hub ${fmtBytes(b.hub)} · store ${fmtBytes(b.store)}`;
    const ratios = Object.values(run.curves.peers).map((c) => latest(c.codec_ratio)).filter((x) => x !== null);
    const cfg = run.config;
    fill($("summary"),
      stat("version", run.version < 0 ? "–" : String(run.version), run.version < 0 ? "not initialised" : `${fmtNum(Math.max(run.version, 0))} rounds closed`),
      stat("peers live", `${live} / ${run.peers.length}`, `min ${cfg.min_peers}`),
      stat("last round", last ? fmtSecs(last.closed - last.opened) : "–", last ? `${last.participants.length} peers` : "none yet"),
      stat("throughput", rate ? `${fmtVal(rate)}` : "–", rate ? "samples/s" : ""),
      stat("bytes up", fmtBytes(run.traffic.up.hub + run.traffic.up.store), via(run.traffic.up)),
      stat("bytes down", fmtBytes(run.traffic.down.hub + run.traffic.down.store), via(run.traffic.down)),
      stat("codec", cfg.codec, ratios.length ? `${(ratios.reduce((a, b) => a + b) / ratios.length).toFixed(1)}× smaller` : cfg.codec === "fp32" ? "no compression" : ""),
      stat("outer", cfg.outer, cfg.outer === "diloco" ? `lr ${cfg.outer_lr}, μ ${cfg.outer_momentum}, warm-up ${cfg.outer_warmup ?? 0}` : "weighted mean"),
      stat("rounds", cfg.policy, { barrier: "every peer's N steps", samples: `close at ${fmtNum(cfg.round_samples)} samples`, async: `no barrier, staleness ≤ ${cfg.max_staleness}` }[cfg.policy] || ""),
      stat("model", run.parameters ? fmtNum(run.parameters) : "–", run.parameters ? `params, ${run.tensors} tensors` : ""),
      stat("downloads", run.store ? "object store" : "hub", run.store || "results and versions from the hub's disk"),
      stat("interval", run.interval ? `${fmtNum(run.interval.every)} ${run.interval.unit}` : "peers'",
        run.interval ? run.interval.why : "sync_every set by each peer"),
      // the ledger (core/ledger.py): every sample a peer reported, acknowledged or lost
      stat("samples lost", fmtNum(run.ledger.lost), `${fmtNum(run.ledger.acknowledged)} acknowledged` +
        run.ledger.peers.filter((p) => p.lost).map((p) => ` · ${p.peer} ${fmtNum(p.lost)}`).join("")),
    );
  }

  function renderPeers(run, colors) {
    const el = $("peers");
    if (!run.peers.length) return fill(el, h("p", { class: "empty-note" }, "No peer has joined yet."));
    const head = ["rank", "peer", "ranks", "state", "last seen", "samples", "samples/s", "up", "down", "loss", "val ppl"];
    const left = new Set(["peer", "state"]);
    fill(el, h("div", { class: "scroll" }, h("table", {},
      h("thead", {}, h("tr", {}, head.map((c) => h("th", { scope: "col", class: left.has(c) ? "l" : null }, c)))),
      h("tbody", {}, run.peers.map((p) => {
        const c = run.curves.peers[p.peer] || {};
        return h("tr", { "data-peer": p.peer },
          h("td", {}, p.rank === null ? "–" : p.rank),
          h("td", { class: "l" }, h("span", { class: "swatch", style: `background:${colors.get(p.peer)}` }), p.peer),
          h("td", { title: "processes (GPUs) of the torch.distributed group that trains as this peer" }, p.group_size),
          h("td", { class: "l" }, h("span", { class: `badge ${p.state}`, title: stateHelp(p.state) }, p.state)),
          h("td", { "data-age": p.last_seen_seconds }, fmtAgo(p.last_seen_seconds)),
          h("td", {}, fmtNum(p.samples)),
          h("td", {}, p.samples_per_second ? fmtVal(p.samples_per_second) : "–"),
          h("td", {}, fmtBytes(p.bytes_up)),
          h("td", {}, fmtBytes(p.bytes_down)),
          h("td", {}, fmtVal(latest(c.loss))),
          h("td", {}, fmtVal(latest(c.val_ppl))),
        );
      })),
    )));
  }

  function stateHelp(st) {
    return {
      live: "its lease is fresh: rounds wait for it",
      late: "a round closed without it: it is catching up",
      gone: "its lease expired: rounds no longer wait for it",
      left: "it left the run",
    }[st] || "";
  }

  function renderOpen(run) {
    const el = $("open");
    const cfg = run.config;
    const o = run.open_round;
    $("open-title").textContent = run.sealed ? `Open round ${o.round}` : "Waiting to start";
    if (run.version < 0) {
      return fill(el, h("p", { class: "empty-note" }, "Waiting for the first peer to upload version 0 (the initial weights); every other peer starts from it."));
    }
    if (!run.sealed) {
      const joined = run.peers.filter((p) => p.state !== "left").length;
      return fill(el, h("p", { class: "empty-note" }, `Waiting for peers: ${joined} of ${cfg.min_peers} have joined. The run starts when ${cfg.min_peers} are in.`));
    }
    const expected = run.peers.filter((p) => p.rank !== null && p.state === "live" && p.active_from <= o.round).map((p) => p.peer);
    const pending = expected.filter((n) => !o.submitted.includes(n) && !o.uploading.includes(n));
    const chips = (names, cls) => (names.length ? names.map((n) => h("span", { class: `chip ${cls}` }, n)) : h("span", { class: "muted" }, "none"));
    if (cfg.policy === "async") {
      return fill(el, h("dl", { class: "kv" },
        h("dt", {}, "applying"), h("dd", {}, chips(o.submitted, "done")),
        h("dt", {}, "uploading"), h("dd", {}, chips(o.uploading, "busy")),
        h("dt", {}, "lease"), h("dd", {}, `${fmtSecs(run.lease_seconds)} without a request and a peer is gone`),
      ), h("p", { class: "note" }, `Asynchronous: each update is applied as it arrives, weighted by its samples and (1 + staleness)^-½; one computed from a version more than ${cfg.max_staleness} behind is refused.`));
    }
    let deadline;
    if (o.closing) deadline = h("span", {}, "aggregating…");
    else if (o.waiting_on_floor) deadline = h("span", { class: "chip wait" }, `waiting for min_merge_peers: ${o.submitted.length} of ${o.merge_floor} updates`);
    else if (o.seconds_left === null) deadline = h("span", { class: "muted" }, `starts with the first update (${fmtSecs(cfg.round_timeout)} timeout)`);
    else deadline = h("span", { "data-countdown": o.seconds_left }, `in ${fmtSecs(o.seconds_left)}`);
    const samples = cfg.policy === "samples"
      ? [h("dt", {}, "samples"), h("dd", {}, `${fmtNum(o.samples)} of ${fmtNum(cfg.round_samples)}`, o.due ? h("span", { class: "chip busy" }, "due: every peer sends now") : null)]
      : [];
    fill(el, h("dl", { class: "kv" },
      ...samples,
      h("dt", {}, "submitted"), h("dd", {}, chips(o.submitted, "done")),
      h("dt", {}, "uploading"), h("dd", {}, chips(o.uploading, "busy")),
      h("dt", {}, "waiting for"), h("dd", {}, chips(pending, "wait")),
      h("dt", {}, "stragglers dropped"), h("dd", {}, deadline),
      h("dt", {}, "lease"), h("dd", {}, `${fmtSecs(run.lease_seconds)} without a request and a peer is gone`),
    ), h("p", { class: "note" }, cfg.policy === "samples"
      ? `The round is due once the peers together trained ${fmtNum(cfg.round_samples)} samples; it closes when every live peer that trained has sent what it has, or at the deadline; never with fewer than ${o.merge_floor} update(s) (min_merge_peers). A gone peer is not waited for.`
      : `The round closes when every live peer has submitted, or at its deadline; never with fewer than ${o.merge_floor} update(s) (min_merge_peers). A gone peer is not waited for.`));
  }

  // ---- the timeline: phases of every peer, stacked like a trace viewer -------------------------
  // Two views: "per round" gives each round the same width and spans it from its first upload
  // to its last download (the sync phases, readable even when training takes minutes);
  // "wall clock" draws the rounds on one time axis, training included.
  function timelineMode() {
    return localStorage.getItem("weightsync.timeline") === "wall" ? "wall" : "rounds";
  }

  function renderTimelineModes() {
    const mode = timelineMode();
    fill($("timeline-mode"), [["rounds", "per round"], ["wall", "wall clock"]].map(([m, label]) =>
      h("button", { type: "button", "data-mode": m, "aria-pressed": String(m === mode), onclick: () => {
        localStorage.setItem("weightsync.timeline", m);
        if (state.data) render(state.data);
      } }, label)));
  }

  function roundWindow(r, withTraining) {
    let lo = r.opened, hi = r.closed;
    for (const l of r.lanes) {
      for (const [phase, a, b] of l.spans) {
        if (phase === "train" && !withTraining) continue;
        lo = Math.min(lo, a);
        hi = Math.max(hi, b);
      }
    }
    return [lo, hi];
  }

  function renderTimeline(run, colors) {
    const el = $("timeline");
    renderTimelineModes();
    const mode = timelineMode();
    fill($("phase-legend"), PHASES.filter(([k]) => mode === "wall" || k !== "train").map(([k, label]) =>
      h("span", {}, h("span", { class: "swatch", style: `background:${css(`--ph-${k}`)}` }), label)));
    const rounds = run.trace.slice(-TIMELINE_ROUNDS);
    if (!rounds.length) return fill(el, h("p", { class: "empty-note" }, "The timeline appears when the first round closes: upload, waiting for stragglers, aggregation and download of every peer."));
    const lanes = run.peers.map((p) => p.peer).filter((n) => rounds.some((r) => r.lanes.some((l) => l.peer === n) || r.dropped.includes(n)));
    const width = Math.max(480, el.clientWidth || 900);
    const labelW = 110, top = 20, laneH = 28, bottom = 26, gap = 14;
    const height = top + lanes.length * laneH + bottom;
    const inner = width - labelW - 8;
    const svg = s("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `timeline of rounds ${rounds[0].round} to ${rounds[rounds.length - 1].round}`, "data-mode": mode });
    lanes.forEach((name, i) => {
      svg.append(s("text", { class: "lane-label", x: 0, y: top + i * laneH + laneH / 2 + 4 }, name.length > 14 ? `${name.slice(0, 13)}…` : name));
    });
    // x(round, t): where time t of round r goes
    let x;
    if (mode === "wall") {
      let t0 = Infinity, t1 = -Infinity;
      for (const r of rounds) { const [a, b] = roundWindow(r, true); t0 = Math.min(t0, a); t1 = Math.max(t1, b); }
      x = (r, t) => labelW + ((t - t0) / Math.max(t1 - t0, 1e-6)) * inner;
      for (const t of ticks(0, t1 - t0, Math.max(2, Math.floor(inner / 110)))) {
        const xx = labelW + (t / Math.max(t1 - t0, 1e-6)) * inner;
        svg.append(s("line", { class: "gridline", x1: xx, x2: xx, y1: top - 4, y2: height - bottom }));
        svg.append(s("text", { x: xx, y: height - 8, "text-anchor": "middle" }, fmtSecs(t)));
      }
    } else {
      const col = (inner - gap * (rounds.length - 1)) / rounds.length;
      const windows = new Map(rounds.map((r, i) => [r.round, [i, ...roundWindow(r, false)]]));
      x = (r, t) => {
        const [i, lo, hi] = windows.get(r.round);
        return labelW + i * (col + gap) + ((t - lo) / Math.max(hi - lo, 1e-6)) * col;
      };
      rounds.forEach((r, i) => {
        const [, lo, hi] = windows.get(r.round);
        const x0 = labelW + i * (col + gap);
        svg.append(s("rect", { class: "column", x: x0 - gap / 2 + 1, y: top - 4, width: col + gap - 2, height: height - top - bottom + 8, rx: 4 }));
        svg.append(s("text", { x: x0 + col / 2, y: height - 8, "text-anchor": "middle" }, fmtSecs(hi - lo)));
      });
    }
    for (const r of rounds) {
      const xc = x(r, r.closed);
      svg.append(s("line", { class: "round-mark", x1: xc, x2: xc, y1: top - 6, y2: height - bottom }));
      svg.append(s("text", { class: "round-label", x: mode === "wall" ? xc : x(r, roundWindow(r, false)[0]), y: top - 9, "text-anchor": mode === "wall" ? "end" : "start" }, `round ${r.round} → v${r.round + 1}`));
      for (const lane of r.lanes) {
        const i = lanes.indexOf(lane.peer);
        if (i < 0) continue;
        for (const [phase, a, b] of lane.spans) {
          if (phase === "train" && mode !== "wall") continue;
          const xa = x(r, a), xb = x(r, b);
          svg.append(s("rect", {
            class: `span ${phase}`, x: xa, y: top + i * laneH + 3, width: Math.max(1, xb - xa), height: laneH - 6,
            fill: css(`--ph-${phase}`), "data-phase": phase,
          }, s("title", {}, `${lane.peer} · round ${r.round} · ${phase}: ${fmtSecs(b - a)}`)));
        }
      }
      for (const name of r.dropped) {
        const i = lanes.indexOf(name);
        if (i < 0) continue;
        svg.append(s("text", { x: xc - 4, y: top + i * laneH + laneH / 2 + 4, "text-anchor": "end", style: `fill:${css("--gone")}` }, "✕ dropped"));
      }
    }
    fill(el, svg);
    const syncShare = syncFraction(rounds);
    if (syncShare !== null) {
      el.append(h("p", { class: "note" }, `Syncing (upload to download) took ${(100 * syncShare).toFixed(syncShare < 0.1 ? 1 : 0)}% of the wall time of these rounds; the rest is training.`));
    }
  }

  function syncFraction(rounds) {
    // from the first round's first upload to the last round's last download, the share spent
    // between a round's first upload and its last download
    if (rounds.length < 2) return null;
    const windows = rounds.map((r) => roundWindow(r, false));
    const total = windows[windows.length - 1][1] - windows[0][0];
    const sync = windows.reduce((a, [lo, hi]) => a + hi - lo, 0);
    return total > 0 ? Math.min(1, sync / total) : null;
  }

  // ---- line charts -------------------------------------------------------------------------------
  function ticks(lo, hi, count, integer = false) {
    const span = hi - lo || Math.abs(hi) || 1;
    const raw = Math.max(span / Math.max(1, count), integer ? 1 : 0);
    const mag = 10 ** Math.floor(Math.log10(raw));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((st) => st >= raw && (!integer || Number.isInteger(st))) || 10 * mag;
    const out = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(Number(t.toPrecision(12)));
    return out;
  }

  function logTicks(lo, hi) {
    const out = [];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) {
      for (const m of [1, 2, 5]) { const t = m * 10 ** e; if (t >= lo && t <= hi) out.push(t); }
    }
    return out.length >= 2 ? out : null;
  }

  function lineChart(el, series, { xLabel, yLabel, height = 210 }) {
    const width = Math.max(260, el.clientWidth || 400);
    const m = { l: 50, r: 12, t: 10, b: 34 };
    const pts = series.flatMap((sr) => sr.points);
    let [x0, x1] = [Math.min(...pts.map((p) => p[0])), Math.max(...pts.map((p) => p[0]))];
    let [y0, y1] = [Math.min(...pts.map((p) => p[1])), Math.max(...pts.map((p) => p[1]))];
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    const log = y0 > 0 && y1 / y0 > 10; // perplexity from a random start spans decades
    if (!log) {
      if (y0 === y1) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
      const pad = (y1 - y0) * 0.08;
      y0 -= pad; y1 += pad;
    }
    const fy = log ? Math.log10 : (v) => v;
    const [fy0, fy1] = [fy(y0), fy(y1)];
    const X = (v) => m.l + ((v - x0) / (x1 - x0)) * (width - m.l - m.r);
    const Y = (v) => m.t + (1 - (fy(v) - fy0) / (fy1 - fy0)) * (height - m.t - m.b);
    const svg = s("svg", { width, height, viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `${yLabel} against ${xLabel}` });
    const yt = (log && logTicks(y0, y1)) || ticks(y0, y1, 4);
    for (const t of yt) {
      if (t < y0 || t > y1) continue;
      svg.append(s("line", { class: "gridline", x1: m.l, x2: width - m.r, y1: Y(t), y2: Y(t) }));
      svg.append(s("text", { x: m.l - 6, y: Y(t) + 4, "text-anchor": "end" }, fmtVal(t)));
    }
    const integerX = pts.every((p) => Number.isInteger(p[0])); // steps and rounds
    for (const t of ticks(x0, x1, Math.max(2, Math.floor((width - m.l) / 70)), integerX)) {
      if (t < x0 || t > x1) continue;
      svg.append(s("text", { x: X(t), y: height - m.b + 16, "text-anchor": "middle" }, fmtVal(t)));
    }
    svg.append(s("line", { class: "axis", x1: m.l, x2: width - m.r, y1: height - m.b, y2: height - m.b }));
    svg.append(s("text", { x: (m.l + width - m.r) / 2, y: height - 3, "text-anchor": "middle" }, xLabel));
    for (const sr of series) {
      if (!sr.points.length) continue;
      const d = sr.points.map(([a, b], i) => `${i ? "L" : "M"}${X(a).toFixed(1)},${Y(b).toFixed(1)}`).join("");
      svg.append(s("path", { class: "line", d, stroke: sr.color, "data-peer": sr.name }));
      if (sr.points.length <= 80) {
        for (const [a, b] of sr.points) {
          svg.append(s("circle", { cx: X(a), cy: Y(b), r: 2.6, fill: sr.color }, s("title", {}, `${sr.name} · ${xLabel} ${fmtVal(a)} · ${yLabel} ${fmtVal(b)}`)));
        }
      }
    }
    const legend = h("div", { class: "legend" }, series.filter((sr) => sr.points.length).map((sr) =>
      h("span", {}, h("span", { class: "swatch", style: `background:${sr.color}` }), sr.name, h("b", {}, fmtVal(latest(sr.points))))));
    fill(el, svg, legend);
  }

  function seriesOf(run, colors, key) {
    // in rank order (the colors' order), so legends read like the peers table
    return [...colors.keys()]
      .filter((name) => run.curves.peers[name])
      .map((name) => ({ name, color: colors.get(name), points: run.curves.peers[name][key] || [] }))
      .filter((sr) => sr.points.length);
  }

  function emptyNote(el, ...content) {
    fill(el, h("p", { class: "empty-note" }, content));
  }

  function renderCurves(run, colors) {
    const xLabel = run.curves.x;
    const loss = seriesOf(run, colors, "loss");
    if (loss.length) lineChart($("chart-loss"), loss, { xLabel, yLabel: "loss" });
    else emptyNote($("chart-loss"), "No training loss yet. Peers report it with their updates: ", h("code", {}, 'sync(model, samples=n, metrics={"loss": …})'), " (SyncCallback does it for you).");
    const ppl = seriesOf(run, colors, "val_ppl");
    if (ppl.length) lineChart($("chart-ppl"), ppl, { xLabel, yLabel: "perplexity" });
    else emptyNote($("chart-ppl"), "No validation yet. Peers report it as ", h("code", {}, "eval_loss"), " or ", h("code", {}, "eval_ppl"), " in the metrics of an update (the Trainer's evaluation rides along with the next sync).");
    const el = $("chart-codec");
    if (run.config.codec === "fp32") {
      return emptyNote(el, "Compression is off: codec ", h("code", {}, "fp32"), " sends float32 deltas, 4 bytes per parameter. A run created with ", h("code", {}, 'codec="int8"'), " sends about 4× fewer bytes, with error feedback.");
    }
    const err = seriesOf(run, colors, "codec_error");
    if (!err.length) return emptyNote(el, `Codec ${run.config.codec}: its compression ratio and error arrive with the first update.`);
    lineChart(el, err, { xLabel, yLabel: "relative error", height: 188 });
    const ratios = seriesOf(run, colors, "codec_ratio").map((sr) => latest(sr.points));
    const ratio = ratios.reduce((a, b) => a + b, 0) / Math.max(1, ratios.length);
    el.prepend(h("p", { class: "note", style: "margin:0 0 6px" }, h("b", {}, `${run.config.codec}: ${ratio.toFixed(1)}× fewer bytes than float32`), " · relative error ‖δ − decoded‖ / ‖δ‖ per update"));
  }

  // ---- rounds table -----------------------------------------------------------------------------
  function phaseTotals(traceRound) {
    const out = { upload: null, wait: null, download: null };
    if (!traceRound) return out;
    for (const lane of traceRound.lanes) {
      for (const k of Object.keys(out)) {
        const d = lane.spans.filter((sp) => sp[0] === k).reduce((a, sp) => a + sp[2] - sp[1], 0);
        if (lane.spans.some((sp) => sp[0] === k)) out[k] = Math.max(out[k] || 0, d);
      }
    }
    return out;
  }

  function shares(traceRound, total) {
    if (!traceRound || !total) return "–";
    return traceRound.lanes.map((lane) => `${lane.peer} ${Math.round((100 * lane.samples) / total)}%${lane.staleness ? ` (s=${lane.staleness})` : ""}`).join(" · ");
  }

  function renderRounds(run) {
    const el = $("rounds");
    if (!run.rounds.length) {
      return emptyNote(el, run.sealed ? "No round has closed yet. The first closes when every live peer has sent its update." : "Rounds start once the run has its peers.");
    }
    const trace = new Map(run.trace.map((t) => [t.round, t]));
    const head = ["round", "peers", "dropped", "samples", "share of samples", "in", "out", "upload", "wait", "aggregate", "download", "total", "computing", "next", "where the time went"];
    const left = new Set(["dropped", "share of samples"]);
    const rows = run.rounds.slice(-TABLE_ROUNDS).reverse().map((r) => {
      const p = phaseTotals(trace.get(r.round));
      const agg = (r.timings.fold || 0) + (r.timings.merge || 0);
      const parts = [["upload", p.upload], ["wait", p.wait], ["aggregate", agg], ["download", p.download]];
      const sum = parts.reduce((a, [, v]) => a + (v || 0), 0);
      const bar = h("div", { class: "bar", title: parts.map(([k, v]) => `${k} ${fmtSecs(v)}`).join(" · ") },
        sum > 0 ? parts.filter(([, v]) => v).map(([k, v]) => h("span", { style: `width:${(100 * v) / sum}%;background:${css(`--ph-${k}`)}` })) : null);
      return h("tr", { "data-round": r.round },
        h("td", {}, r.round),
        h("td", { title: r.participants.join(", ") }, r.participants.length),
        h("td", { class: `l ${r.dropped.length ? "dropped" : ""}` }, r.dropped.join(", ") || "–"),
        h("td", {}, fmtNum(r.samples)),
        h("td", { class: "l", title: "each participant's part of the round's samples; s: its staleness (versions its base lagged)" }, shares(trace.get(r.round), r.samples)),
        h("td", {}, fmtBytes(r.bytes_in)),
        h("td", { title: "size of the merged update each peer downloads" }, fmtBytes(r.result_bytes)),
        h("td", {}, fmtSecs(p.upload)),
        h("td", {}, fmtSecs(p.wait)),
        h("td", { title: `fold ${fmtSecs(r.timings.fold)} + merge ${fmtSecs(r.timings.merge)}` }, fmtSecs(agg)),
        h("td", {}, fmtSecs(p.download)),
        h("td", { title: "first update to publication" }, fmtSecs(r.closed - r.opened)),
        h("td", { title: "sync_every auto: the slowest peer's share of its last interval spent computing" },
          r.interval && r.interval.utilization !== null ? `${(100 * r.interval.utilization).toFixed(1)}%` : "–"),
        h("td", { title: r.interval ? `picked: ${r.interval.bound}` : "the peers' own interval" }, r.interval ? fmtNum(r.interval.every) : "–"),
        h("td", {}, bar),
      );
    });
    fill(el, h("div", { class: "scroll" }, h("table", {},
      h("thead", {}, h("tr", {}, head.map((c) => h("th", { scope: "col", class: left.has(c) ? "l" : null }, c)))),
      h("tbody", {}, rows),
    )), h("p", { class: "note" }, "Upload and download: the slowest peer; wait: the longest any peer waited for stragglers; total: from the round's first update to its publication."));
  }

  function renderReducers(reducers, now) {
    $("reducers-card").hidden = !reducers.length;
    if (!reducers.length) return;
    const head = ["reducer", "leases", "busy", "last lease", "lease time, total", "expired", "read + written", "last seen"];
    const rows = reducers.map((r) => h("tr", {},
      h("td", { class: "l" }, r.name),
      h("td", {}, fmtNum(r.leases)),
      h("td", {}, r.busy ? "yes" : "–"),
      h("td", {}, fmtSecs(r.last_seconds)),
      h("td", {}, fmtSecs(r.seconds)),
      h("td", { class: r.expired ? "dropped" : null, title: "leases it took and lost (not renewed in time): redone by another" }, fmtNum(r.expired)),
      h("td", {}, fmtBytes(r.bytes)),
      h("td", { "data-age": Math.max(0, now - r.last_seen) }, fmtAgo(Math.max(0, now - r.last_seen))),
    ));
    fill($("reducers"), h("div", { class: "scroll" }, h("table", {},
      h("thead", {}, h("tr", {}, head.map((c) => h("th", { scope: "col", class: c === "reducer" ? "l" : null }, c)))),
      h("tbody", {}, rows),
    )));
  }

  function tick() {
    if (!state.at) return;
    const dt = (Date.now() - state.at) / 1000;
    for (const el of document.querySelectorAll("[data-age]")) el.textContent = fmtAgo(Number(el.dataset.age) + dt);
    for (const el of document.querySelectorAll("[data-countdown]")) el.textContent = `in ${fmtSecs(Math.max(0, Number(el.dataset.countdown) - dt))}`;
  }

  poll();
})();
