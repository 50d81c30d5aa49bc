"""Start-up cost of the proxy process, trees compared in one run, alternating.

    python bench/startup.py --tree base=/tmp/base --tree new=. [--rounds 7]

Per tree and round: the CPU (user+sys) of `python -c "import proxy.app.runtime"`; the wall
time from exec of `envelope-proxy serve` (the bundled policies, sqlite state in a temporary
directory) to the first /readyz 200; the wall time of `envelope-proxy check policies`.
Medians are printed with each tree's ratio to the first. Each tree runs with PYTHONPATH set
to it; byte code is compiled first (as in the image), PYTHONDONTWRITEBYTECODE is kept.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _env(tree: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    check = subprocess.run([sys.executable, "-c", "import proxy; print(proxy.__file__)"], env=env,
                           cwd=NEUTRAL, capture_output=True, text=True, check=True)
    assert check.stdout.startswith(str(tree)), (tree, check.stdout)  # the tree measured is `tree`
    return env


# Not a tree: `python -c` and `-m` put the working directory first on sys.path.
NEUTRAL = tempfile.gettempdir()


def _child_cpu(cmd: list[str], env: dict[str, str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=NEUTRAL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def import_cpu(tree: Path) -> float:
    return _child_cpu([sys.executable, "-c", "import proxy.app.runtime"], _env(tree))


def ready_wall(tree: Path) -> float:
    listen, admin = _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="startup-") as state:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--policies", str(tree / "policies"),
             "--listen", f"127.0.0.1:{listen}", "--admin", f"127.0.0.1:{admin}", "--state-dir", state],
            env=_env(tree), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=state)
        try:
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=1) as r:
                        if r.status == 200:
                            return time.perf_counter() - started
                except OSError:
                    pass
                if proc.poll() is not None:
                    raise RuntimeError(f"serve exited {proc.returncode}")
                if time.perf_counter() - started > 60:
                    raise RuntimeError("not ready in 60 s")
                time.sleep(0.01)
        finally:
            proc.terminate()
            proc.wait(30)


def check_wall(tree: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "proxy", "check", str(tree / "policies")], env=_env(tree),
                   check=True, stdout=subprocess.DEVNULL, cwd=NEUTRAL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH (first: the reference)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    trees = [(name, Path(path).resolve()) for name, _, path in (t.partition("=") for t in args.tree)]
    for _, tree in trees:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "proxy")], check=True,
                       stdout=subprocess.DEVNULL)
    measures = {"import CPU s": import_cpu, "serve exec -> /readyz 200 s": ready_wall, "check wall s": check_wall}
    results: dict[tuple[str, str], list[float]] = {}
    print(f"load average before: {os.getloadavg()}")
    for _ in range(args.rounds):
        for what, measure in measures.items():
            for name, tree in trees:
                results.setdefault((what, name), []).append(measure(tree))
    print(f"load average after: {os.getloadavg()}")
    for what in measures:
        first = statistics.median(results[(what, trees[0][0])])
        for name, _ in trees:
            m = statistics.median(results[(what, name)])
            samples = " ".join(f"{v:.2f}" for v in results[(what, name)])
            print(f"{what:30} {name:8} median {m:.3f}  x{m / first:.2f}  [{samples}]")


if __name__ == "__main__":
    main()
