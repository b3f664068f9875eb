"""Certificates for the admission webhook: a private CA and the serving certificate it signs.
Pure: PEM bytes and times in, PEM bytes out (no API, no files, no clock).

Model
-----
The API server calls the webhook over TLS at the webhook Service (``<svc>.<ns>.svc``) and checks
the serving certificate against the ``caBundle`` of the MutatingWebhookConfiguration.  In the
self-managed mode the partitioner is its own CA; :class:`Material` is what it keeps (in a
Secret, see :mod:`partitioner.webhook_certs`):

``ca_bundle``
    PEM certificates the API server trusts: the current CA first, then earlier CAs that are
    still valid (kept through a CA rollover, so a replica still serving a certificate of the
    old CA stays trusted while the others switch).
``ca_key``
    The current CA's private key (to sign the next serving certificate).
``cert``, ``key``
    The serving certificate, signed by the current CA, with the Service's DNS names as SANs
    (Go's TLS client, in the API server, ignores the common name), and its key.

All keys are ECDSA P-256 (fast to generate, accepted by the API server).  Lifetimes: CA
:data:`CA_DAYS`, serving certificate :data:`SERVING_DAYS`, both starting one hour in the past
(clock skew between nodes).

Renewal (:func:`renewal_reason`, checked at start-up and periodically):

* nothing usable (missing, unreadable, key not matching its certificate, serving certificate
  not issued by the current CA) -> a new CA and a new serving certificate;
* the CA ends within :data:`SERVING_DAYS` -> a new CA (the old one stays in the bundle until it
  expires) and a new serving certificate;
* the serving certificate does not name every DNS name, or less than a third of its lifetime is
  left (about four months before it ends) -> a new serving certificate from the current CA.

Whoever issues a new CA while other certificates may still be served (a replica that lost the
Secret, see :mod:`partitioner.webhook_certs`) adds the CAs those are signed by to the new bundle
(:func:`with_cas`); :func:`trusts` says whether a bundle lets the API server verify a given
serving certificate.
"""

from __future__ import annotations

import base64
import binascii
import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CA_DAYS",
    "SERVING_DAYS",
    "CertificateError",
    "Material",
    "issue",
    "renewal_reason",
    "renewed",
    "service_dns_names",
    "trusts",
    "with_cas",
]

CA_DAYS = 3650
SERVING_DAYS = 365
_SKEW = datetime.timedelta(hours=1)
_SECRET_KEYS = ("ca.crt", "ca.key", "tls.crt", "tls.key")


class CertificateError(ValueError):
    """Certificate material cannot be read; the message says which part and why."""


def service_dns_names(service: str, namespace: str) -> tuple[str, ...]:
    """The names the API server may use for a Service: ``<svc>.<ns>.svc`` (what it sends as the
    TLS server name) and the fully qualified ``<svc>.<ns>.svc.cluster.local``."""
    return (f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local")


@dataclass(frozen=True, slots=True)
class Material:
    ca_bundle: bytes
    ca_key: bytes
    cert: bytes
    key: bytes

    def secret_data(self) -> dict[str, str]:
        """The Secret's ``data`` (base64): ``ca.crt``, ``ca.key``, ``tls.crt``, ``tls.key``."""
        raw = (self.ca_bundle, self.ca_key, self.cert, self.key)
        return {
            k: base64.b64encode(v).decode("ascii") for k, v in zip(_SECRET_KEYS, raw, strict=True)
        }

    @classmethod
    def from_secret_data(cls, data: Mapping[str, str]) -> Material:
        """Read a Secret's ``data``; :class:`CertificateError` names a missing or bad key."""
        values: list[bytes] = []
        for key in _SECRET_KEYS:
            if not data.get(key):
                raise CertificateError(f"the Secret has no {key!r}")
            try:
                values.append(base64.b64decode(data[key], validate=True))
            except (binascii.Error, ValueError):
                raise CertificateError(f"the Secret's {key!r} is not base64") from None
        return cls(*values)

    def server_pem(self) -> bytes:
        """Private key and certificate in one PEM file: one atomic write, so a server never
        loads a key with another certificate."""
        return self.key + self.cert

    def not_after(self) -> datetime.datetime:
        """When the serving certificate ends."""
        return _load_cert(self.cert, "tls.crt").not_valid_after_utc


def _load_cert(pem: bytes, what: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as e:
        raise CertificateError(f"{what} is not a PEM certificate: {e}") from None


def _load_bundle(pem: bytes) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(pem)
    except ValueError as e:
        raise CertificateError(f"ca.crt is not a PEM certificate bundle: {e}") from None
    return list(certs)


def _load_key(pem: bytes, what: str) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise CertificateError(f"{what} is not an unencrypted PEM private key: {e}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(f"{what} is not an ECDSA key")
    return key


def _same_key(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    return cert.public_key() == key.public_key()


def _dns_names(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return set(san.get_values_for_type(x509.DNSName))


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """Signatures (ECDSA TLS); a CA also signs certificates and CRLs."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _new_ca(now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    # A distinct name per CA, so the old and the new CA of a rollover are told apart by name too.
    name = x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, f"gpuslice webhook CA {now:%Y%m%dT%H%M%SZ}")]
    )
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _new_serving(
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    dns_names: Sequence[str],
    now: datetime.datetime,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(min(now + datetime.timedelta(days=SERVING_DAYS), ca.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _still_valid(
    certs: Iterable[x509.Certificate], now: datetime.datetime
) -> list[x509.Certificate]:
    return [c for c in certs if c.not_valid_after_utc > now]


def issue(dns_names: Sequence[str], now: datetime.datetime) -> Material:
    """A new CA and a serving certificate for ``dns_names`` (the first is the common name)."""
    if not dns_names:
        raise ValueError("a serving certificate needs at least one DNS name")
    ca, ca_key = _new_ca(now)
    cert, key = _new_serving(ca, ca_key, dns_names, now)
    return Material(_pem_cert(ca), _pem_key(ca_key), _pem_cert(cert), _pem_key(key))


def renewal_reason(
    material: Material | None, dns_names: Sequence[str], now: datetime.datetime
) -> str:
    """Why ``material`` must be renewed at ``now`` (see the module docstring), or ``""``."""
    if material is None:
        return "no certificate yet"
    try:
        bundle = _load_bundle(material.ca_bundle)
        ca_key = _load_key(material.ca_key, "ca.key")
        cert = _load_cert(material.cert, "tls.crt")
        key = _load_key(material.key, "tls.key")
    except CertificateError as e:
        return str(e)
    ca = bundle[0]
    if not _same_key(ca, ca_key):
        return "ca.key does not belong to the first certificate of ca.crt"
    if not _same_key(cert, key):
        return "tls.key does not belong to tls.crt"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return "tls.crt was not issued by the current CA"
    if ca.not_valid_after_utc - now < datetime.timedelta(days=SERVING_DAYS):
        return f"the CA ends {ca.not_valid_after_utc:%Y-%m-%d}"
    missing = set(dns_names) - _dns_names(cert)
    if missing:
        return f"tls.crt does not name {', '.join(sorted(missing))}"
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    if cert.not_valid_after_utc - now < lifetime / 3:
        return f"tls.crt ends {cert.not_valid_after_utc:%Y-%m-%d}"
    return ""


def renewed(
    material: Material | None, dns_names: Sequence[str], now: datetime.datetime
) -> Material:
    """New material for ``dns_names``: from the current CA when it is sound and far from its
    end, else from a new CA with the earlier, still valid CAs kept in the bundle."""
    if material is not None:
        try:
            bundle = _load_bundle(material.ca_bundle)
            ca, ca_key = bundle[0], _load_key(material.ca_key, "ca.key")
        except CertificateError:
            pass
        else:
            sound = _same_key(ca, ca_key) and ca.not_valid_after_utc - now >= datetime.timedelta(
                days=SERVING_DAYS
            )
            kept = b"".join(_pem_cert(c) for c in _still_valid(bundle, now))
            if sound:
                cert, key = _new_serving(ca, ca_key, dns_names, now)
                return Material(kept, material.ca_key, _pem_cert(cert), _pem_key(key))
            fresh = issue(dns_names, now)
            return Material(fresh.ca_bundle + kept, fresh.ca_key, fresh.cert, fresh.key)
    return issue(dns_names, now)


def _certificates(pem: bytes) -> list[x509.Certificate]:
    """The certificates in ``pem``; none when it is not a readable PEM bundle."""
    try:
        return _load_bundle(pem) if pem else []
    except CertificateError:
        return []


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def trusts(bundle: bytes, cert: bytes) -> bool:
    """Whether a client trusting only ``bundle`` (PEM CAs: a caBundle) accepts the serving
    certificate ``cert`` as issued by one of them (its names and dates aside)."""
    try:
        served = _load_cert(cert, "tls.crt")
    except CertificateError:
        return False
    for ca in _certificates(bundle):
        try:
            served.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return True
    return False


def with_cas(material: Material, extra: bytes, now: datetime.datetime) -> Material:
    """``material`` with the CA certificates of ``extra`` (PEM; unreadable parts ignored) that
    are still valid at ``now`` and not in its bundle yet appended to its bundle (after its own
    CAs: the first stays the current one)."""
    have = _certificates(material.ca_bundle)
    added: list[x509.Certificate] = []
    for c in _still_valid(_certificates(extra), now):
        if _is_ca(c) and c not in have and c not in added:
            added.append(c)
    if not added:
        return material
    bundle = material.ca_bundle + b"".join(_pem_cert(c) for c in added)
    return Material(bundle, material.ca_key, material.cert, material.key)
