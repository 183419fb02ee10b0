"""A real OpenSSH server inside a namespace host, with a host key and a user key made by the test.

``with ssh_keys(tmp) as keys: port = start_sshd(host, keys)`` then
``hvdrun -p PORT -i keys.user_key --ssh-option UserKnownHostsFile=keys.known_hosts ...``.
The server runs until the cluster is torn down (it is one of the host's processes).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.multihost.netns import Host

__all__ = ["SSHD", "SSH_PORT", "SshKeys", "make_keys", "ssh_skip_reason", "start_sshd", "hvdrun_ssh_args"]

SSHD = "/usr/sbin/sshd"
SSH_PORT = 2222
"""Port of every test sshd (each host has its own network namespace, so one port fits all)."""

@dataclass(frozen=True)
class SshKeys:
    folder: Path
    user_key: Path
    known_hosts: Path

def ssh_skip_reason() -> str | None:
    """Why the ssh tests cannot run here (no sshd / ssh / ssh-keygen), or None."""
    missing = [p for p in (SSHD, "ssh", "ssh-keygen") if shutil.which(p) is None]
    return f"needs OpenSSH ({', '.join(missing)} missing; Debian: openssh-server)" if missing else None

def make_keys(folder: Path) -> SshKeys:
    """A user key pair and an empty known_hosts file in ``folder`` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = folder / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    (folder / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    (folder / "known_hosts").write_text("")
    return SshKeys(folder, key, folder / "known_hosts")

def _config(host: Host, keys: SshKeys) -> Path:
    host_key = keys.folder / f"host_key_{host.name}"
    if not host_key.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    config = keys.folder / f"sshd_config_{host.name}"
    config.write_text("\n".join([
        f"Port {SSH_PORT}", "ListenAddress 0.0.0.0", f"HostKey {host_key}",
        f"AuthorizedKeysFile {keys.folder / 'authorized_keys'}", "PermitRootLogin prohibit-password",
        "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
        f"PidFile {keys.folder / f'sshd_{host.name}.pid'}", "LogLevel ERROR", "MaxStartups 50",
        "MaxSessions 50", "",
    ]))
    return config

def start_sshd(host: Host, keys: SshKeys, timeout_seconds: float = 20.0) -> int:
    """Start sshd in ``host`` on :data:`SSH_PORT`; returns the port once it accepts connections.

    Raises:
        AssertionError: sshd exited or did not listen within ``timeout_seconds`` (its stderr included).
    """
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation directory
    proc = host.popen([SSHD, "-D", "-e", "-f", str(_config(host, keys))], stdout=subprocess.DEVNULL,
                      stderr=subprocess.PIPE, text=True)
    probe = ("import socket,sys\ntry:\n"
             f" socket.create_connection(('127.0.0.1', {SSH_PORT}), timeout=1).close()\n"
             "except OSError: sys.exit(1)\n")
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"sshd on {host.name} exited with {proc.returncode}: {proc.stderr.read()}")
        if host.run([sys.executable, "-c", probe], timeout=10).returncode == 0:
            return SSH_PORT
        time.sleep(0.2)
    raise AssertionError(f"sshd on {host.name} did not listen on {SSH_PORT} within {timeout_seconds} s")

def hvdrun_ssh_args(keys: SshKeys) -> list[str]:
    """hvdrun's flags for the test sshds: Horovod's ``-p``/``-i`` and a known_hosts file of the test."""
    return ["-p", str(SSH_PORT), "-i", str(keys.user_key), "--ssh-option",
            f"UserKnownHostsFile={keys.known_hosts}", "--ssh-option", "StrictHostKeyChecking=accept-new"]
