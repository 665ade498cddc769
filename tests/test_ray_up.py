"""`ray up` / `ray down` end to end: Ray's own cluster launcher (on-prem provider, `type: local`) drives
this machine over SSH, from cluster/onprem-loopback.yaml.in.

Two "machines", head 127.0.0.5 and worker 127.0.0.6: each an sshd (Debian's openssh-server) on a free port,
run by the test in its own PID + mount namespace (`unshare --pid --fork --mount-proc`), so the `ray stop`
that `ray down` runs on the head over SSH only sees that namespace. Inside the namespaces an /etc/passwd
copy is bind-mounted whose root home is a test directory: the launcher's ~/ray_bootstrap_config.yaml,
~/ray_bootstrap_key.pem, the copied ~/.ray/auth_token and the ~/.ssh/config that gives the head's
autoscaler the worker's SSH port stay there. Token auth is on everywhere. Everything is stopped by process
group (the namespace's init, and with it every process of the namespace) and the test's files are removed.

Needs the apt packages openssh-server (sshd) and rsync (file mounts); skipped without sshd.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import yaml
from multinode import RAY, ROOT, alive, alive_nodes, free_port, read_metrics, token_env

from rlplatform.infra.loopback import CLUSTER_RAY_ENV, node_process

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"
TEMPLATE = ROOT / "cluster" / "onprem-loopback.yaml.in"
HEAD_IP, WORKER_IP = "127.0.0.5", "127.0.0.6"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
    pytest.mark.skipif(not os.path.exists(SSHD), reason="sshd not installed (apt-get install openssh-server rsync)"),
]

# ProxyCommand for `ray up`: stdin/stdout <-> HOST:PORT (the launcher has no SSH port option).
RELAY = """\
import socket, sys, threading
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))
def up():
    while True:
        data = sys.stdin.buffer.raw.read(65536)
        if not data:
            break
        sock.sendall(data)
    sock.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while True:
    data = sock.recv(65536)
    if not data:
        break
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
"""

SSHD_CONFIG = """\
ListenAddress {ip}:{port}
HostKey {base}/ssh_host_ed25519_key
AuthorizedKeysFile {base}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
PrintMotd no
MaxStartups 50
MaxSessions 50
PidFile {base}/sshd-{name}.pid
"""

# Inside the new mount namespace only: root's home is the test's directory.
NAMESPACE_INIT = 'mount --bind "$0" /etc/passwd && exec "$1" -D -e -f "$2"'


def _sshd_up(ip: str, port: int) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1) as sock:
            return sock.recv(8).startswith(b"SSH-")
    except OSError:
        return False


def _tcp_open(ip: str, port: int) -> bool:
    try:
        socket.create_connection((ip, port), timeout=1).close()
        return True
    except OSError:
        return False


class Machine:
    """An sshd on IP:PORT in its own PID and mount namespace."""

    def __init__(self, name: str, ip: str, port: int, base: Path):
        self.name, self.ip, self.port = name, ip, port
        config = base / f"sshd-{name}.conf"
        config.write_text(SSHD_CONFIG.format(ip=ip, port=port, base=base, name=name))
        self.log = base / f"sshd-{name}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child",
                 "sh", "-c", NAMESPACE_INIT, str(base / "passwd"), SSHD, str(config)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 20
        while not _sshd_up(ip, port):
            if self.process.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"sshd on {ip}:{port} did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        # The group holds unshare and the namespace's init (sshd): when init dies, the kernel kills
        # every process of the namespace, including the Ray started through SSH.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=10)


def _ssh_key(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "rlp-ray-up", "-f", str(path)], check=True)


def _render(values: dict[str, object]) -> str:
    text = TEMPLATE.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", str(value))
    assert "@" not in "".join(line.split("#")[0] for line in text.splitlines()), "unfilled placeholder"
    return text


def _launcher(verb: str, config: Path, env: dict[str, str], timeout: float, *flags: str) -> subprocess.CompletedProcess:
    """`python -m rlplatform cluster up|down CONFIG`: `ray up -y` / `ray down -y` with the on-prem fixes."""
    return subprocess.run([sys.executable, "-m", "rlplatform", "cluster", verb, str(config), *flags], env=env,
                          cwd=config.parent, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def _kill_by_cmdline(fragment: str) -> None:
    """Our own stragglers only: processes whose command line holds this test's unique path."""
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            cmdline = (proc_dir / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if fragment in cmdline and int(proc_dir.name) != os.getpid():
            try:
                os.kill(int(proc_dir.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_ray_up_and_down_on_this_machine() -> None:
    assert shutil.which("rsync"), "ray up needs rsync for its file mounts (apt-get install rsync)"
    assert shutil.which("ssh") and shutil.which("ssh-keygen"), "openssh-client missing"
    base = Path(tempfile.mkdtemp(prefix="rlpup-", dir="/tmp"))  # short: Ray's unix socket paths are limited
    cluster_name = f"rlp-rayup-{uuid.uuid4().hex[:8]}"
    # The launcher's SSH ControlPath (command_runner.py): per user and cluster name.
    control_dir = Path("/tmp") / f"ray_ssh_{hashlib.sha256(getpass.getuser().encode()).hexdigest()[:10]}"
    control_path = control_dir / hashlib.sha256(cluster_name.encode()).hexdigest()[:10]
    machines: list[Machine] = []
    sentinel = None
    bootstrap_files = ("ray_bootstrap_config.yaml", "ray_bootstrap_key.pem")
    real_home = {name: (Path.home() / name).exists() for name in bootstrap_files}
    try:
        env = token_env()  # RAY_AUTH_MODE=token, and a token in ~/.ray/auth_token (or RAY_AUTH_TOKEN_PATH)
        if env.get("RAY_AUTH_TOKEN"):
            token_file = base / "auth_token"
            token_file.write_text(env["RAY_AUTH_TOKEN"])
        else:
            token_file = Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        assert token_file.is_file(), f"no Ray auth token at {token_file}"
        env["TMPDIR"] = str(base)  # ray up/down: config cache, cluster state file, bootstrap temp files
        # Not set here: `rlplatform cluster up` must itself run `ray up` with the v1 autoscaler for a
        # `provider: local` config (v2 never launches its workers, ray-project/ray#57153).
        env.pop("RAY_UP_enable_autoscaler_v2", None)

        # The SSH user's home inside the namespaces.
        home = base / "home"
        (home / ".ssh").mkdir(parents=True)
        passwd = []
        for line in Path("/etc/passwd").read_text().splitlines():
            fields = line.split(":")
            if fields[0] == "root":
                fields[5] = str(home)
            passwd.append(":".join(fields))
        (base / "passwd").write_text("\n".join(passwd) + "\n")
        # The login shell's PATH has no virtualenv; `ray down` runs a bare `ray stop` on the head (commands.py).
        (home / ".bashrc").write_text(f'export PATH="{Path(RAY).parent}:$PATH"\n')
        ssh_port = free_port()
        # Ray drops ssh_proxy_command from the config it gives the head: its autoscaler finds the port here.
        (home / ".ssh" / "config").write_text(f"Host {HEAD_IP} {WORKER_IP}\n  Port {ssh_port}\n")

        _ssh_key(base / "ssh_host_ed25519_key")
        _ssh_key(base / "id_ed25519")
        shutil.copy(base / "id_ed25519.pub", base / "authorized_keys")
        (base / "relay.py").write_text(RELAY)
        Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)  # sshd's privilege separation dir

        # A process outside the namespaces that `ray stop` would kill if it escaped them: comm "raylet".
        shutil.copy("/bin/sleep", base / "raylet")
        sentinel = subprocess.Popen([str(base / "raylet"), "600"], start_new_session=True)

        machines.append(Machine("head", HEAD_IP, ssh_port, base))
        machines.append(Machine("worker", WORKER_IP, ssh_port, base))

        gcs_port = free_port()
        address = f"{HEAD_IP}:{gcs_port}"
        config_text = _render({
            "CLUSTER_NAME": cluster_name, "HEAD_IP": HEAD_IP, "WORKER_IP": WORKER_IP,
            "SSH_KEY": base / "id_ed25519",
            "PROXY_COMMAND": f"{sys.executable} {base / 'relay.py'} %h {ssh_port}",
            "TOKEN_FILE": token_file, "RAY": RAY, "TMPDIR": base, "GCS_PORT": gcs_port,
            "HEAD_TEMP_DIR": base / "h", "WORKER_TEMP_DIR": base / "w", "DASHBOARD_PORT": free_port(),
            "HEAD_AGENT_PORT": free_port(), "WORKER_AGENT_PORT": free_port(), "CLIENT_PORT": free_port(),
            "AUTOSCALER_METRIC_PORT": free_port(),
        })
        config = base / "cluster.yaml"
        config.write_text(config_text)

        from ray.autoscaler._private.util import prepare_config, validate_config

        validate_config(prepare_config(yaml.safe_load(config_text)))

        started = time.time()
        up = _launcher("up", config, env, 240, "--no-config-cache")
        assert up.returncode == 0, (up.stdout + up.stderr)[-6000:]
        assert (home / "ray_bootstrap_config.yaml").is_file() and (home / ".ray" / "auth_token").is_file()
        assert (home / ".ray" / "auth_token").read_text().strip() == token_file.read_text().strip()

        # The head answers a driver (token auth, explicit address); the autoscaler brings the worker up.
        deadline = time.time() + 120
        nodes = 0
        while time.time() < deadline:
            try:
                nodes = alive_nodes(address, env)
            except (IndexError, ValueError, subprocess.TimeoutExpired):
                nodes = 0
            if nodes == 2:
                break
            time.sleep(2)
        monitor_log = "".join(p.read_text(errors="replace")[-4000:]
                              for p in (base / "h").glob("session_*/logs/monitor.*"))
        assert nodes == 2, f"{nodes} alive nodes at {address} after ray up; monitor log:\n{monitor_log}"
        print(f"ray up + worker joined in {time.time() - started:.0f} s")
        # The head's GCS runs with the cluster configs' task-event limit (bench soak --nodes measured it).
        gcs = node_process(base / "h", "gcs_server")
        assert {k: gcs.environ().get(k) for k in CLUSTER_RAY_ENV} == CLUSTER_RAY_ENV

        # A tiny real training run on the launched cluster, its env runner on the other node.
        runs = base / "runs"
        train = subprocess.run(
            [sys.executable, "-m", "rlplatform", "train", "--address", address, "--runs-dir", str(runs),
             "--set", "scale.placement=spread", "--set", "stop.iterations=1", "--set", "scale.env_runners=1",
             "--set", "scale.envs_per_runner=1",
             "--set", "training.train_batch_size_per_learner=200", "--set", "training.minibatch_size=100",
             "--set", "training.num_epochs=1", "--set", "checkpoint.every=0"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
        assert train.returncode == 0, (train.stdout + train.stderr)[-4000:]
        (run_dir,) = [p for p in runs.glob("*/*") if (p / "manifest.json").is_file()]
        assert len(read_metrics(run_dir)) == 1
        placement = json.loads((run_dir / "manifest.json").read_text())["placement"]
        assert len({placement["algorithm_node"], *placement["env_runner_nodes"]}) == 2, placement

        down = _launcher("down", config, env, 120)
        assert down.returncode == 0, (down.stdout + down.stderr)[-6000:]
        output = down.stdout + down.stderr
        assert "Exception occurred when stopping the cluster Ray runtime" not in output, output[-4000:]
        deadline = time.time() + 30
        while _tcp_open(HEAD_IP, gcs_port) and time.time() < deadline:
            time.sleep(0.5)
        assert not _tcp_open(HEAD_IP, gcs_port), "the head's GCS still answers after ray down"
        assert all(m.process.poll() is None for m in machines), "an sshd died"
        assert alive(sentinel.pid), "ray down's `ray stop` killed a process outside the head's namespace"
        assert {name: (Path.home() / name).exists() for name in real_home} == real_home, "the launcher wrote into ~"
    finally:
        for machine in reversed(machines):
            machine.stop()
        if sentinel is not None:
            sentinel.kill()
            sentinel.wait()
        _kill_by_cmdline(str(control_path))  # ssh ControlMaster processes of `ray up` (ControlPersist 10 s)
        _kill_by_cmdline(str(base))  # ProxyCommand relays
        shutil.rmtree(control_path, ignore_errors=True)
        try:
            control_dir.rmdir()  # only if no other cluster's control path is in it
        except OSError:
            pass
        shutil.rmtree(base, ignore_errors=True)
