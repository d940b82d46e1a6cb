"""A buffer sent just before its exporter exits still arrives with its bytes: a keeper process
serves what the exporter held (docs/memory.md, "When the exporter exits"). On simulated GPUs
(CPU tier) and on the real GPU (``pytest -m gpu``).

The exporters here are child processes that send and then end normally, as a Ray GPU task's
worker does after its task (Ray's default for ``num_gpus > 0`` is ``max_calls=1``).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
from memtier import check, exited_cleanly, fill, ray_get, ray_on, wait_until

import gpu_serde
from helpers import TESTS

# An exporter that allocates, fills with the test pattern, sends (prints the pickle) and exits.
SEND_AND_EXIT = """
import os, pickle, resource, sys
if os.environ.get("AWKWARD"):  # a daemon's: no stdin (the holds file gets descriptor 0), and
    os.close(0)  # more than 1024 descriptors open (select() cannot watch them)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))
    extra = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
sys.path.insert(0, sys.argv[2])
import gpu_serde
from cuda.core import Device, DeviceMemoryResource, DeviceMemoryResourceOptions
from cuda.core import VirtualMemoryResource, VirtualMemoryResourceOptions
from memtier import fill
gpu_serde.install(); d = Device(0); d.set_current()
size = int(sys.argv[3])
out = []
for kind in sys.argv[1].split(","):
    if kind == "arena":
        mr = gpu_serde.ArenaMemoryResource(d, 2 * size)
    elif kind == "vmm":
        mr = VirtualMemoryResource(d, VirtualMemoryResourceOptions())
    else:
        mr = DeviceMemoryResource(d, DeviceMemoryResourceOptions(ipc_enabled=True, max_size=2 * size))
    buf = mr.allocate(size, stream=d.default_stream)
    fill(buf)
    out.append(pickle.dumps(buf).hex())
    del buf  # the exporter drops its own reference: the hold keeps the memory
print(" ".join(out), flush=True)
"""


@pytest.fixture
def gpu(tier, monkeypatch):
    from cuda.core import Device

    gpu_serde.visible_devices()  # this process's view, before a child's environment is set
    gpu_serde.install()
    monkeypatch.setenv("GPU_SERDE_RELEASE_GRACE_S", "0.2")  # exporters let go soon
    dev = Device(tier.ordinal)
    dev.set_current()
    yield dev
    gpu_serde.uninstall()


# Every exporter these tests start carries this mark in its environment, and so does its
# keeper: keepers() counts this test process's only (other test runs on the host start theirs).
MARK = {"GPU_SERDE_TEST_KEEPERS_OF": f"{os.getpid()}-{time.monotonic_ns()}"}
_MARKED = "".join(f"{k}={v}" for k, v in MARK.items()).encode()


def keepers() -> set[int]:
    """The pids of the keeper processes of the exporters this test process started."""
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"gpu_serde.memory.broker.keeper" not in f.read():
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if _MARKED in f.read().split(b"\0"):
                        found.add(int(pid))
            except OSError:
                continue
    return found


def run_exporter(tier, kinds: str, code: str = SEND_AND_EXIT, **env: str):
    """Run an exporter (``code``: by default one that sends one buffer of each kind,
    comma-separated) to its end, on the tier's GPU; what it printed, once it exited cleanly."""
    environ = dict(os.environ, CUDA_VISIBLE_DEVICES=tier.uuid, **MARK, **env)
    done = subprocess.run(
        [sys.executable, "-c", code, kinds, TESTS, str(tier.size)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=120,
    )
    assert exited_cleanly(done.returncode), done.stderr
    return done


def arena_exporter_to(tier, stderr: int, environ: dict[str, str]):
    """Run an exporter that sends one arena buffer and exits, its stderr the descriptor
    ``stderr``; what it did (its payload on stdout)."""
    return subprocess.run(
        [sys.executable, "-c", SEND_AND_EXIT, "arena", TESTS, str(tier.size)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=environ,
        timeout=120,
    )


def send_and_exit(tier, kinds: str, **env: str) -> list[bytes]:
    """Run an exporter that sends one buffer of each kind (comma-separated) and exits; its
    payloads, once it has exited."""
    done = run_exporter(tier, kinds, **env)
    assert "could not be handed" not in done.stderr, done.stderr
    assert "keeper process" not in done.stderr  # not a terminal (a worker's log): nothing said
    return [bytes.fromhex(h) for h in done.stdout.split()]


@pytest.mark.parametrize("kind", ["arena", "vmm"])
def test_a_buffer_sent_just_before_its_exporter_exits_arrives_with_its_bytes(gpu, tier, kind):
    before = keepers()
    (blob,) = send_and_exit(tier, kind)
    new = keepers() - before
    assert len(new) == 1  # one keeper serves what the exporter held
    buf = pickle.loads(blob)
    got = check(buf)
    assert got["ok"] and got["size"] == tier.size
    buf.close()
    del buf
    # the receiver let go: the keeper lets go too, and ends (the memory goes with its
    # descriptors once this process unmaps it)
    assert wait_until(lambda: not (keepers() & new), timeout=30)


def read_terminal(master: int) -> str:
    """What was written to a pseudo-terminal whose other end is closed."""
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: all read, and no writer left
            break
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


def test_an_exporter_run_at_a_terminal_says_which_keeper_serves_what_it_sent(gpu, tier):
    import pty

    before = keepers()
    master, terminal = pty.openpty()
    try:
        environ = dict(os.environ, CUDA_VISIBLE_DEVICES=tier.uuid, **MARK)
        environ.pop("GPU_SERDE_KEEPER_LOG", None)
        done = arena_exporter_to(tier, terminal, environ)
        os.close(terminal)
        terminal = -1
        said = read_terminal(master)
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(master)
    assert exited_cleanly(done.returncode), said
    new = keepers() - before
    assert len(new) == 1
    assert f"gpu_serde: keeper process {new.pop()} serves the GPU memory" in said, said
    buf = pickle.loads(bytes.fromhex(done.stdout.split()[0]))
    assert check(buf)["ok"]
    buf.close()
    del buf
    assert wait_until(lambda: not (keepers() - before), timeout=30)


def test_an_exporter_without_stdin_and_with_many_descriptors_hands_off_too(gpu, tier):
    (blob,) = send_and_exit(tier, "arena", AWKWARD="1")
    assert check(pickle.loads(blob))["ok"]


def test_the_keeper_keeps_a_released_buffer_for_the_grace_period(gpu, tier, monkeypatch):
    """A receiver that forwards a buffer and closes it does not lose it for the next process,
    as with a live exporter."""
    from memtier import child

    (blob,) = send_and_exit(tier, "arena", GPU_SERDE_RELEASE_GRACE_S="5")
    buf = pickle.loads(blob)
    forwarded = pickle.dumps(buf)  # travels on as it came
    buf.close()
    del buf
    time.sleep(1.5)  # the keeper sees the lock free, and waits out the grace period
    with child(monkeypatch, tier.uuid) as c:
        got = c.run(check, pickle.loads(forwarded))
    assert got["ok"]


def keeper_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_the_keeper_closes_what_it_let_go_while_it_keeps_the_rest(gpu, tier):
    before = keepers()
    first, second = send_and_exit(tier, "vmm,vmm")
    (keeper,) = keepers() - before
    a, b = pickle.loads(first), pickle.loads(second)
    assert check(a)["ok"] and check(b)["ok"]
    held_both = keeper_fds(keeper)
    a.close()
    del a
    # a's descriptor is closed (its memory goes once this process unmaps it); b's is kept
    assert wait_until(lambda: keeper_fds(keeper) == held_both - 1, timeout=30)
    assert check(b)["ok"]
    b.close()
    del b
    assert wait_until(lambda: keeper not in keepers(), timeout=30)


def test_a_buffer_sent_again_by_its_receiver_reaches_a_third_process_through_the_keeper(
    gpu, tier, monkeypatch
):
    from memtier import child

    (blob,) = send_and_exit(tier, "arena")
    buf = pickle.loads(blob)
    with child(monkeypatch, tier.uuid) as c:
        got = c.run(check, buf)  # travels on as it came: the keeper serves the third process
    assert got["ok"] and got["pid"] != os.getpid()


def test_a_payload_no_one_claims_is_kept_for_keep_s_then_is_exporter_gone(gpu, tier):
    before = keepers()
    (blob,) = send_and_exit(tier, "arena", GPU_SERDE_KEEP_S="1")
    new = keepers() - before
    assert len(new) == 1
    assert wait_until(lambda: not (keepers() & new), timeout=30)  # kept 1 s, then let go
    got = pickle.loads(blob)  # never raises: the error waits for use
    with pytest.raises(gpu_serde.ExporterGoneError):
        gpu_serde.resolve(got)


def test_an_expired_payload_says_so_while_the_keeper_keeps_others(gpu, tier):
    kept, expired = send_and_exit(tier, "arena,arena", GPU_SERDE_KEEP_S="1")
    buf = pickle.loads(kept)  # claimed at once: kept while held
    time.sleep(3)  # the other expires
    with pytest.raises(gpu_serde.ExporterGoneError, match="GPU_SERDE_KEEP_S"):
        gpu_serde.resolve(pickle.loads(expired))
    assert check(buf)["ok"]


def test_the_keepers_log_says_what_it_served_and_why_it_ended(gpu, tier, tmp_path):
    log = tmp_path / "keeper.log"
    log.write_text("an earlier line\n")  # appended to, never truncated
    before = keepers()
    send_and_exit(tier, "arena", GPU_SERDE_KEEP_S="1", GPU_SERDE_KEEPER_LOG=str(log))  # unclaimed
    (keeper,) = keepers() - before
    assert wait_until(lambda: keeper not in keepers(), timeout=30)  # it expired after 1 s
    text = log.read_text()
    assert text.startswith("an earlier line\n")
    said = [line for line in text.splitlines() if f"gpu_serde keeper {keeper}: " in line]
    assert len(said) == 2, text
    assert f"gpu_serde keeper {keeper}: serving @gpu_serde-" in said[0]
    assert "objects held or unclaimed: 1 (an unclaimed one is kept 1 s)" in said[0]
    assert said[1].endswith(f"gpu_serde keeper {keeper}: nothing is held any more: exiting")


def test_a_keeper_log_the_exporter_creates_is_for_its_user_only(gpu, tier, tmp_path):
    log = tmp_path / "keeper.log"
    (blob,) = send_and_exit(tier, "arena", GPU_SERDE_KEEPER_LOG=str(log))
    assert log.stat().st_mode & 0o777 == 0o600
    assert check(pickle.loads(blob))["ok"]


@pytest.mark.parametrize(
    "log", ["missing folder", "folder", "fifo", "fifo with a reader", "device", "relative", "home"]
)
def test_a_keeper_log_that_cannot_be_used_is_said_and_the_keeper_serves_all_the_same(
    gpu, tier, tmp_path, log
):
    path = tmp_path / "keeper.log"
    reader = None
    if log == "missing folder":
        path = tmp_path / "no" / "keeper.log"
    elif log == "folder":
        path.mkdir()
    elif log.startswith("fifo"):
        os.mkfifo(path)  # no reader will come: opening it must not wait for one
        if log == "fifo with a reader":
            reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    elif log == "device":
        path = Path(os.devnull)
    else:  # found from the exporter's folder, wherever that is (~ is the shell's, not ours)
        path = Path("keeper.log" if log == "relative" else "~/keeper.log")
    try:
        done = run_exporter(tier, "arena", GPU_SERDE_KEEPER_LOG=str(path))
    finally:
        if reader is not None:
            os.close(reader)
    why = {
        "missing folder": "does not exist",
        "relative": "is not an absolute path",
        "home": "is not an absolute path (~ is not expanded",
    }.get(log, "is not a regular file")
    # said when the process first sent memory (a warning at the line that sent it, not in
    # gpu_serde), and again at its exit
    sends = 1 + next(i for i, line in enumerate(SEND_AND_EXIT.splitlines()) if "dumps" in line)
    assert f"<string>:{sends}: UserWarning: GPU_SERDE_KEEPER_LOG: " in done.stderr, done.stderr
    assert "gpu_serde: GPU_SERDE_KEEPER_LOG: " in done.stderr and why in done.stderr
    assert "the keeper logs nothing: name a regular file" in done.stderr
    buf = pickle.loads(bytes.fromhex(done.stdout.split()[0]))
    assert check(buf)["ok"]


def test_an_exporter_whose_stderr_is_gone_still_hands_off_with_a_bad_keeper_log(gpu, tier):
    """Nothing said at exit can stop the hand-off: here the exporter's stderr is a pipe that no
    one reads any more, and its keeper log cannot be opened."""
    environ = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES=tier.uuid,
        GPU_SERDE_KEEPER_LOG="/nonexistent/keeper.log",
        **MARK,
    )
    r, w = os.pipe()
    os.close(r)  # a write to w fails (EPIPE; SIGPIPE is ignored in Python)
    try:
        done = arena_exporter_to(tier, w, environ)
    finally:
        os.close(w)
    assert exited_cleanly(done.returncode)
    assert check(pickle.loads(bytes.fromhex(done.stdout.split()[0])))["ok"]


def test_keep_s_zero_starts_no_keeper(gpu, tier):
    before = keepers()
    (blob,) = send_and_exit(tier, "arena", GPU_SERDE_KEEP_S="0")
    assert not keepers() - before
    with pytest.raises(gpu_serde.ExporterGoneError):
        gpu_serde.resolve(pickle.loads(blob))


def test_a_pool_buffer_whose_exporter_exited_says_its_memory_went_with_it(gpu, tier):
    pool_blob, arena_blob = send_and_exit(tier, "pool,arena")
    with pytest.raises(gpu_serde.ExporterGoneError, match="went with it"):
        gpu_serde.resolve(pickle.loads(pool_blob))
    assert check(pickle.loads(arena_blob))["ok"]  # the arena's, from the same exporter, is kept


def test_an_exporter_whose_receivers_all_let_go_starts_no_keeper(gpu, tier, monkeypatch):
    """The common case pays nothing: what was claimed and released is let go at exit."""
    code = SEND_AND_EXIT.replace(
        'print(" ".join(out), flush=True)',
        "import subprocess\n"
        "for blob in out:\n"
        "    subprocess.run([sys.executable, '-c', 'import pickle, sys, gpu_serde;"
        " gpu_serde.install(); b = pickle.loads(bytes.fromhex(sys.argv[1]));"
        ' gpu_serde.resolve(b).close(); print("closed", flush=True)\', blob])\n',
    )
    before = keepers()
    done = run_exporter(tier, "arena", code)
    assert done.stdout.split() == ["closed"]  # the receiver took it, and let go
    time.sleep(0.5)
    assert not keepers() - before


@pytest.fixture(scope="module")
def ray_session(tier):
    with ray_on(tier, __name__, num_cpus=2) as ray:
        yield ray


def make_in_gpu_task(size: int) -> tuple[int, object]:
    """A Ray GPU task with Ray's default max_calls (1): Ray ends its worker after it."""
    from cuda.core import Device

    d = Device(0)
    d.set_current()
    mr = gpu_serde.ArenaMemoryResource(d, 2 * size)
    buf = mr.allocate(size, stream=d.default_stream)
    fill(buf)
    return os.getpid(), buf


def test_a_buffer_returned_from_a_ray_gpu_task_that_ray_ends_arrives_with_its_bytes(
    ray_session, gpu, tier
):
    ray = ray_session
    make = ray.remote(num_gpus=0.5, num_returns=2)(make_in_gpu_task)  # max_calls: Ray's default
    consume = ray.remote(num_gpus=0.5)(check)
    pid_ref, buf_ref = make.remote(tier.size)
    pid = ray_get(pid_ref)
    assert wait_until(lambda: not os.path.exists(f"/proc/{pid}"), timeout=60)  # Ray ended it
    got = ray_get(consume.remote(buf_ref))
    assert got["ok"] and got["size"] == tier.size and got["pid"] != pid


# A parent that starts a multiprocessing child (the start method in argv[4]) which allocates,
# fills, sends and ends; the parent prints the pickle once the child has ended. The parent never
# makes a CUDA context, so even a forked child can use CUDA; and each run has a forkserver of
# its own, with this environment.
MP_PARENT = """
import multiprocessing, sys
sys.path.insert(0, sys.argv[2])
from memtier import send_arena_buffer

if __name__ == "__main__":
    ctx = multiprocessing.get_context(sys.argv[4])
    blobs = ctx.Queue()
    child = ctx.Process(target=send_arena_buffer, args=(int(sys.argv[3]), blobs))
    child.start()
    blob = blobs.get(timeout=120)
    child.join(60)
    print(child.exitcode, blob, flush=True)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_a_multiprocessing_child_that_sends_and_ends_hands_off_too(gpu, tier, method):
    """A multiprocessing child ends with os._exit, which runs no atexit: gpu_serde hooks the
    hand-off into multiprocessing's own exit."""
    environ = dict(os.environ, CUDA_VISIBLE_DEVICES=tier.uuid)
    done = subprocess.run(
        [sys.executable, "-c", MP_PARENT, "arena", TESTS, str(tier.size), method],
        capture_output=True,
        text=True,
        env=environ,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    code, blob = done.stdout.split()
    assert exited_cleanly(int(code)), done.stderr
    assert check(pickle.loads(bytes.fromhex(blob)))["ok"]


def test_a_gone_exporter_says_what_keeps_memory_and_what_does_not(gpu, tier):
    (blob,) = send_and_exit(tier, "pool")  # no keeper: nothing it sent is kept
    with pytest.raises(gpu_serde.ExporterGoneError, match=r"ArenaMemoryResource.*GPU_SERDE_KEEP_S"):
        gpu_serde.resolve(pickle.loads(blob))


def test_an_invalid_keep_s_is_a_warning_when_the_process_first_sends(gpu, tier):
    stderr = run_exporter(tier, "arena", GPU_SERDE_KEEP_S="soon").stderr
    assert "GPU_SERDE_KEEP_S='soon' is not a number of seconds" in stderr
    assert "no keeper will serve what this process sends" in stderr  # said at the send
