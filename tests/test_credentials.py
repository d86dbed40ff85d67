"""`fedlora credentials`: a CA, the SuperLink's TLS certificate, SuperNode keys Flower accepts, the secret."""

import ipaddress
import re
import stat

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

import pytest

from fedlora.credentials import MAX_NODES, make_credentials


def test_credentials_have_one_folder_per_machine(tmp_path):
    creds = make_credentials(tmp_path, hosts=("127.0.0.1", "superlink.example"), nodes=3)
    ca = x509.load_pem_x509_certificate(creds.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(creds.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert names.get_values_for_type(x509.DNSName) == ["superlink.example"]
    secrets = set()
    for i in range(3):
        folder = creds.node_dir(i)
        # exactly what flower-supernode and `flwr supernode register` load
        key = load_ssh_private_key((folder / "node.key").read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        assert load_ssh_public_key((folder / "node.pub").read_bytes()).public_numbers() == \
            key.public_key().public_numbers()
        assert (folder / "ca.crt").read_bytes() == creds.ca_cert.read_bytes()
        secrets.add((folder / "sketch-secret").read_text())
        for private in ("node.key", "sketch-secret"):
            assert stat.S_IMODE((folder / private).stat().st_mode) == 0o600
    assert len(secrets) == 1  # the nodes share one secret
    assert not list((tmp_path / "superlink").glob("*secret*"))  # the server never gets it
    assert stat.S_IMODE((tmp_path / "ca" / "ca.key").stat().st_mode) == 0o600


@pytest.mark.parametrize("hosts, nodes, message", [
    (("192.168.1.5:9092",), 2, "--host '192.168.1.5:9092' is not a host name or IP address"),  # a port
    (("https://superlink.example",), 2, "--host 'https://superlink.example' is not a host name"),
    (("superlink.example", "bad_name"), 2, "--host 'bad_name' is not a host name"),
    ((), 2, "Name at least one host"),
    (("::1",), MAX_NODES + 1, f"nodes must lie in [1, {MAX_NODES}], got {MAX_NODES + 1}."),
])
def test_a_host_no_certificate_name_matches_and_too_many_nodes_are_refused_before_anything_is_written(
        tmp_path, hosts, nodes, message):
    """A port or scheme in --host would become a certificate name no connection matches: TLS would fail only
    when the SuperNodes connect."""
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        make_credentials(tmp_path / "creds", hosts=hosts, nodes=nodes)
    assert not (tmp_path / "creds").exists()
