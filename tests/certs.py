"""A throw-away CA and certificates for TLS tests (cryptography): a server certificate for
`server_names` (DNS names and IP addresses) and a client certificate, both signed by the CA."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def make_certs(tmp: Path, server_names: tuple[str, ...] = ("localhost", "127.0.0.1"),
               server_usage: tuple[str, ...] | None = None) -> dict[str, str]:
    """Paths of ca, server, server_key, client, client_key (PEM). `server_usage`: extended key usages
    of the server certificate ("serverAuth", "clientAuth"); None leaves the extension out (any use)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def alt(n: str):
        try:
            return x509.IPAddress(ipaddress.ip_address(n))
        except ValueError:
            return x509.DNSName(n)

    def cert(subject, key, issuer, issuer_key, ca=False, san=None, usage=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(hours=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        if usage is not None:
            oids = {"serverAuth": ExtendedKeyUsageOID.SERVER_AUTH, "clientAuth": ExtendedKeyUsageOID.CLIENT_AUTH}
            b = b.add_extension(x509.ExtendedKeyUsage([oids[u] for u in usage]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    out = {}

    def write(label, obj):
        path = tmp / f"{label}.pem"
        if isinstance(obj, x509.Certificate):
            path.write_bytes(obj.public_bytes(serialization.Encoding.PEM))
        else:
            path.write_bytes(obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        out[label] = str(path)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    write("ca", cert("omni test ca", ca_key, "omni test ca", ca_key, ca=True))
    srv_key = ec.generate_private_key(ec.SECP256R1())
    write("server", cert(server_names[0], srv_key, "omni test ca", ca_key, san=[alt(n) for n in server_names],
                         usage=server_usage))
    write("server_key", srv_key)
    cli_key = ec.generate_private_key(ec.SECP256R1())
    write("client", cert("omni client", cli_key, "omni test ca", ca_key))
    write("client_key", cli_key)
    return out
