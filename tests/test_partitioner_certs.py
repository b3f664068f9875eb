"""The webhook's certificates (partitioner/certs.py): what a TLS client like the API server
accepts, and when the material is renewed.

Trust is checked with a real TLS handshake (Python's ``ssl`` over memory buffers): the client
trusts only the CA bundle and checks the server name, as the API server does.
"""

from __future__ import annotations

import datetime
import ssl
import tempfile
from pathlib import Path

import pytest
from cryptography import x509

from partitioner.certs import (
    CA_DAYS,
    SERVING_DAYS,
    CertificateError,
    Material,
    issue,
    renewal_reason,
    renewed,
    service_dns_names,
    trusts,
    with_cas,
)

NAMES = service_dns_names("gs-gpuslice-webhook", "gpu-system")
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
DAY = datetime.timedelta(days=1)


def handshake(server: Material, trusted: bytes, server_name: str) -> None:
    """One TLS handshake: the server presents ``server``'s certificate, the client trusts only
    ``trusted`` and checks ``server_name``; raises ``ssl.SSLError`` when the client refuses."""
    with tempfile.TemporaryDirectory() as tmp:
        pem = Path(tmp) / "tls.pem"
        pem.write_bytes(server.server_pem())
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(pem, pem)
    client_ctx = ssl.create_default_context(cadata=trusted.decode())
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=server_name)
    srv = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, side, out, peer_in in (
            ("client", client, c_out, s_in),
            ("server", srv, s_out, c_in),
        ):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
            peer_in.write(out.read())
        if all(done.values()):
            return
    raise AssertionError("the handshake did not finish")


def test_serving_certificate_is_trusted_for_the_service_names_only() -> None:
    now = datetime.datetime.now(datetime.UTC)
    material = issue(NAMES, now)
    for name in NAMES:
        handshake(material, material.ca_bundle, name)
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        handshake(material, material.ca_bundle, "other.gpu-system.svc")
    stranger = issue(NAMES, now)  # same names, another CA: not trusted
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
        handshake(material, stranger.ca_bundle, NAMES[0])


def test_issued_material_has_the_documented_shape() -> None:
    m = issue(NAMES, T0)
    (ca,) = x509.load_pem_x509_certificates(m.ca_bundle)
    cert = x509.load_pem_x509_certificate(m.cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == list(NAMES)
    assert ca.not_valid_after_utc == T0 + CA_DAYS * DAY
    assert cert.not_valid_after_utc == T0 + SERVING_DAYS * DAY
    assert cert.not_valid_before_utc < T0  # clock skew allowance
    assert m.not_after() == cert.not_valid_after_utc
    assert renewal_reason(m, NAMES, T0) == ""
    assert Material.from_secret_data(m.secret_data()) == m


def test_serving_certificate_is_renewed_with_a_third_of_its_life_left() -> None:
    m = issue(NAMES, T0)
    third = SERVING_DAYS * DAY / 3
    assert renewal_reason(m, NAMES, T0 + SERVING_DAYS * DAY - third - DAY) == ""
    later = T0 + SERVING_DAYS * DAY - third + DAY
    assert renewal_reason(m, NAMES, later).startswith("tls.crt ends")
    new = renewed(m, NAMES, later)
    assert (new.ca_bundle, new.ca_key) == (m.ca_bundle, m.ca_key)  # same CA: caBundle unchanged
    assert new.cert != m.cert and new.key != m.key
    assert renewal_reason(new, NAMES, later) == ""
    assert new.not_after() == later + SERVING_DAYS * DAY


def test_ca_rollover_keeps_the_old_ca_trusted_until_it_ends() -> None:
    # Handshakes check validity against the real clock: the rollover happens now, on a CA made
    # nine years ago whose current serving certificate was issued ten days ago.
    now = datetime.datetime.now(datetime.UTC)
    start = now - (CA_DAYS - SERVING_DAYS + 1) * DAY
    m = renewed(issue(NAMES, start), NAMES, now - 10 * DAY)
    assert x509.load_pem_x509_certificate(m.cert).not_valid_before_utc > now - 11 * DAY
    near_end = now
    assert renewal_reason(m, NAMES, near_end).startswith("the CA ends")
    new = renewed(m, NAMES, near_end)
    bundle = x509.load_pem_x509_certificates(new.ca_bundle)
    old_ca = x509.load_pem_x509_certificates(m.ca_bundle)[0]
    assert len(bundle) == 2 and bundle[1] == old_ca and bundle[0] != old_ca
    assert new.ca_key != m.ca_key
    assert renewal_reason(new, NAMES, near_end) == ""
    # Both the new certificate and one still served by a replica on the old CA are trusted.
    handshake(new, new.ca_bundle, NAMES[0])
    handshake(m, new.ca_bundle, NAMES[0])
    # Once the old CA has ended, the next renewal drops it from the bundle.
    after = start + (CA_DAYS + 1) * DAY
    pruned = renewed(new, NAMES, after)
    assert x509.load_pem_x509_certificates(pruned.ca_bundle) == [bundle[0]]


@pytest.mark.parametrize(
    ("broken", "reason"),
    [
        ("names", "tls.crt does not name gs-gpuslice-webhook.gpu-system.svc.cluster.local"),
        ("key", "tls.key does not belong to tls.crt"),
        ("ca-key", "ca.key does not belong to the first certificate of ca.crt"),
        ("issuer", "tls.crt was not issued by the current CA"),
        ("garbage", "tls.crt is not a PEM certificate"),
        ("missing", "no certificate yet"),
    ],
)
def test_unsound_material_is_renewed(broken: str, reason: str) -> None:
    m = issue(NAMES, T0)
    other = issue(NAMES, T0)
    bad: Material | None = {
        "names": issue(NAMES[:1], T0),
        "key": Material(m.ca_bundle, m.ca_key, m.cert, other.key),
        "ca-key": Material(m.ca_bundle, other.ca_key, m.cert, m.key),
        "issuer": Material(m.ca_bundle, m.ca_key, other.cert, other.key),
        "garbage": Material(m.ca_bundle, m.ca_key, b"not a certificate", m.key),
        "missing": None,
    }[broken]
    assert renewal_reason(bad, NAMES, T0).startswith(reason)
    new = renewed(bad, NAMES, T0)
    assert renewal_reason(new, NAMES, T0) == ""
    handshake(new, new.ca_bundle, NAMES[1])
    if broken in ("names", "key", "issuer", "garbage"):  # the CA was sound: kept
        assert (new.ca_bundle, new.ca_key) == (bad.ca_bundle, bad.ca_key)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tls.crt": "eA==", "tls.key": "eA==", "ca.crt": "eA=="}, "no 'ca.key'"),
        ({"tls.crt": "eA==", "tls.key": "eA==", "ca.crt": "eA==", "ca.key": "%%"}, "not base64"),
    ],
)
def test_secret_data_errors_name_the_key(data: dict[str, str], message: str) -> None:
    with pytest.raises(CertificateError, match=message):
        Material.from_secret_data(data)


# -- bundles that keep serving certificates trusted (a lost Secret, partitioner/webhook_certs.py)
def test_trusts_accepts_exactly_certificates_signed_by_a_ca_of_the_bundle() -> None:
    a, b = issue(NAMES, T0), issue(NAMES, T0)
    assert trusts(a.ca_bundle, a.cert) and trusts(b.ca_bundle, b.cert)
    assert not trusts(a.ca_bundle, b.cert) and not trusts(b.ca_bundle, a.cert)
    assert trusts(b.ca_bundle + a.ca_bundle, a.cert)  # any CA of the bundle, not only the first
    assert not trusts(b"", a.cert)
    assert not trusts(b"not a bundle", a.cert)
    assert not trusts(a.ca_bundle, b"not a certificate")
    # a serving certificate is no CA: one that names itself is still not trusted by another
    assert not trusts(a.cert, b.cert)


def test_with_cas_appends_the_valid_cas_once_and_keeps_the_current_ca_first() -> None:
    new, old = issue(NAMES, T0 + 10 * DAY), issue(NAMES, T0)
    ended = issue(NAMES, T0 - (CA_DAYS + 1) * DAY)  # its CA ended a day before T0
    now = T0 + 10 * DAY
    kept = with_cas(new, old.ca_bundle + ended.ca_bundle + old.cert + b"junk", now)
    bundle = x509.load_pem_x509_certificates(kept.ca_bundle)
    first = x509.load_pem_x509_certificates(new.ca_bundle)[0]
    assert bundle == [first, x509.load_pem_x509_certificates(old.ca_bundle)[0]]
    assert (kept.ca_key, kept.cert, kept.key) == (new.ca_key, new.cert, new.key)
    assert renewal_reason(kept, NAMES, now) == ""
    assert trusts(kept.ca_bundle, old.cert) and trusts(kept.ca_bundle, new.cert)
    assert not trusts(kept.ca_bundle, ended.cert)
    assert with_cas(kept, old.ca_bundle + new.ca_bundle, now) == kept  # nothing new: unchanged
    assert with_cas(new, b"", now) == new
