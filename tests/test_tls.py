"""The whole sync over HTTPS, with a CA and a certificate made here; refusals without the CA.

The hub serves TLS with uvicorn's ``--ssl-certfile``/``--ssl-keyfile``; the SDK verifies the
certificate by default and takes a CA bundle (``verify=<path>``). A certificate the SDK does
not trust is a setup error: it fails at once with a clear message instead of being retried.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from syncclient import SyncClient
from syncclient.exceptions import HubUnreachable
from syncclient.weights import ModelView
from tests.conftest import Hub
from tests.harness import run_peers
from tests.models import tiny_gpt2

TOKEN = "tls-test-token"


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(
    folder: Path, common_name: str = "weightsync test CA"
) -> tuple[Path, x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA: its certificate (the bundle a peer is given) and its key."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = folder / f"{common_name.replace(' ', '-')}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, cert, key


def make_server_cert(
    folder: Path, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, ip: str = "127.0.0.1"
) -> tuple[Path, Path]:
    """A server certificate for ``ip`` signed by the CA; returns (certfile, keyfile)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("weightsync hub"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    certfile, keyfile = folder / f"hub-{ip}.pem", folder / f"hub-{ip}.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    keyfile.chmod(0o600)
    return certfile, keyfile


@pytest.fixture
def pki(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(CA bundle, hub certificate, hub key)."""
    ca_path, ca_cert, ca_key = make_ca(tmp_path)
    certfile, keyfile = make_server_cert(tmp_path, ca_cert, ca_key)
    return ca_path, certfile, keyfile


def https_hub(hub_factory: Callable[..., Hub], certfile: Path, keyfile: Path) -> Hub:
    return hub_factory("--ssl-certfile", str(certfile), "--ssl-keyfile", str(keyfile), env={"SYNC_TOKEN": TOKEN})


def test_two_peers_sync_over_tls(hub_factory: Callable[..., Hub], pki: tuple[Path, Path, Path]) -> None:
    ca, certfile, keyfile = pki
    hub = https_hub(hub_factory, certfile, keyfile)
    assert hub.url.startswith("https://")

    def peer(i: int) -> dict[str, torch.Tensor]:
        model = tiny_gpt2(seed=i)
        with SyncClient(hub.url, run="tls", peer=f"p{i}", token=TOKEN, min_peers=2, verify=str(ca)) as client:
            client.join(model)
            for r in range(2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.001 * (i + 1) * (r + 1))
                assert client.sync(model, samples=4 + i).version == r + 1
        return {k: torch.from_numpy(v.copy()) for k, v in ModelView(model).export().items()}

    weights = run_peers(2, peer, timeout=120)
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
    r = httpx.get(
        f"{hub.url}/v1/runs/tls",
        headers={"Authorization": f"Bearer {TOKEN}"},
        verify=ssl.create_default_context(cafile=ca),
    )
    assert r.status_code == 200 and r.json()["version"] == 2


def test_untrusted_certificate_fails_at_once(hub_factory: Callable[..., Hub], pki: tuple[Path, Path, Path]) -> None:
    """Without the CA (system trust store) the SDK stops with a clear error, not after retry_seconds."""
    _, certfile, keyfile = pki
    hub = https_hub(hub_factory, certfile, keyfile)
    client = SyncClient(hub.url, run="tls", peer="p0", token=TOKEN, retry_seconds=120)
    started = time.monotonic()
    with pytest.raises(HubUnreachable, match="certificate is not trusted") as caught:
        client.join(tiny_gpt2())
    client.close()
    assert time.monotonic() - started < 10
    assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)


def test_another_ca_is_not_trusted(
    hub_factory: Callable[..., Hub], pki: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    """A CA bundle that did not sign the hub's certificate: refused like no bundle at all."""
    _, certfile, keyfile = pki
    hub = https_hub(hub_factory, certfile, keyfile)
    other_ca, _, _ = make_ca(tmp_path, "some other CA")
    client = SyncClient(hub.url, run="tls", peer="p0", token=TOKEN, verify=str(other_ca), retry_seconds=120)
    started = time.monotonic()
    with pytest.raises(HubUnreachable, match="certificate is not trusted"):
        client.join(tiny_gpt2())
    client.close()
    assert time.monotonic() - started < 10


def test_certificate_for_another_host_is_not_trusted(hub_factory: Callable[..., Hub], tmp_path: Path) -> None:
    """The right CA, but a certificate issued for another address: a man in the middle."""
    ca_path, ca_cert, ca_key = make_ca(tmp_path)
    certfile, keyfile = make_server_cert(tmp_path, ca_cert, ca_key, ip="10.1.2.3")
    hub = https_hub(hub_factory, certfile, keyfile)
    client = SyncClient(hub.url, run="tls", peer="p0", token=TOKEN, verify=str(ca_path), retry_seconds=120)
    with pytest.raises(HubUnreachable, match="certificate is not trusted"):
        client.join(tiny_gpt2())
    client.close()


def test_https_url_to_a_plain_http_hub_fails_at_once(hub_factory: Callable[..., Hub]) -> None:
    hub = hub_factory(env={"SYNC_TOKEN": TOKEN})
    client = SyncClient(hub.url.replace("http://", "https://"), run="tls", peer="p0", token=TOKEN, retry_seconds=120)
    started = time.monotonic()
    with pytest.raises(HubUnreachable, match="does not speak TLS"):
        client.join(tiny_gpt2())
    client.close()
    assert time.monotonic() - started < 10


def test_plain_http_to_a_tls_hub_is_refused(hub_factory: Callable[..., Hub], pki: tuple[Path, Path, Path]) -> None:
    """A peer misconfigured with http:// gets no answer: the hub drops the connection. (Its
    request went out in clear text, token included: hence the SDK's https:// check in docs.)"""
    _, certfile, keyfile = pki
    hub = https_hub(hub_factory, certfile, keyfile)
    with pytest.raises(httpx.HTTPError):
        httpx.get(hub.url.replace("https://", "http://") + "/healthz", timeout=5)
