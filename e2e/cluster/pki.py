"""Certificates and keys for a loopback control plane, made with the `openssl` command.

Why openssl: it is on every machine image we use, and the venv has no crypto package. The CA signs
the API server's serving certificate (for 127.0.0.1 and the in-cluster names) and one admin client
certificate in `system:masters`, which the admin kubeconfig, the controller manager, the scheduler,
kwok and the runner all present. A separate RSA key pair signs service-account tokens.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca_crt(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def serving_crt(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def admin_crt(self) -> Path:
        return self.dir / "admin.crt"

    @property
    def admin_key(self) -> Path:
        return self.dir / "admin.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {proc.stderr.strip()}")


def _sign(d: Path, name: str, subject: str, ext: str) -> None:
    """Make `name.key`, a CSR, and `name.crt` signed by the CA with the given x509v3 extensions."""
    _openssl("genrsa", "-out", f"{name}.key", "2048", cwd=d)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=d)
    # Key identifiers: Python's strict X.509 verification (3.13+) wants them on every leaf.
    (d / f"{name}.ext").write_text(ext + "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "30", "-sha256", "-extfile", f"{name}.ext",
             "-out", f"{name}.crt", cwd=d)


def make_pki(d: Path) -> Pki:
    """Write a fresh CA, serving cert, admin client cert and service-account key pair into `d`."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the `openssl` command is needed to make the cluster's certificates "
                           "(apt-get install openssl)")
    d.mkdir(parents=True, exist_ok=True)
    _openssl("genrsa", "-out", "ca.key", "2048", cwd=d)
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=anneal-e2e-ca", "-days", "30",
             "-sha256", "-out", "ca.crt", cwd=d)
    names = ["kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local", "localhost"]
    sans = ",".join([f"DNS:{n}" for n in names] + ["IP:127.0.0.1", "IP:10.0.0.1"])
    _sign(d, "apiserver", "/CN=kube-apiserver",
          "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
          f"extendedKeyUsage=serverAuth\nsubjectAltName={sans}\n")
    _sign(d, "admin", "/O=system:masters/CN=anneal-e2e-admin",
          "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
          "extendedKeyUsage=clientAuth\n")
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    return Pki(d)


def write_kubeconfig(path: Path, server: str, pki: Pki, user: str = "admin") -> Path:
    """An admin kubeconfig using the client certificate (absolute paths, so it works from anywhere)."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: anneal-e2e
  cluster:
    server: {server}
    certificate-authority: {pki.ca_crt}
users:
- name: {user}
  user:
    client-certificate: {pki.admin_crt}
    client-key: {pki.admin_key}
contexts:
- name: anneal-e2e
  context:
    cluster: anneal-e2e
    user: {user}
    namespace: default
current-context: anneal-e2e
""")
    return path


def write_token_kubeconfig(path: Path, server: str, ca_crt: Path, token: str) -> Path:
    """A kubeconfig for a pod: the service-account token the runner requested for it."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters:
- name: anneal-e2e
  cluster:
    server: {server}
    certificate-authority: {ca_crt}
users:
- name: pod
  user:
    token: {token}
contexts:
- name: in-cluster
  context:
    cluster: anneal-e2e
    user: pod
current-context: in-cluster
""")
    return path
