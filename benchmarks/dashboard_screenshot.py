"""A headless-browser screenshot of the Ray dashboard during an hpsray run (docs/img/dashboard.png).

    apt-get install -y chromium          # Debian's; not part of CI
    python benchmarks/dashboard_screenshot.py [--out docs/img/dashboard.png] [--page actors]

Starts a local Ray with its dashboard (through hpsray's own ``connect``, as ``hpsray train``
does), runs a short pipeline named ``hpsray-demo`` and, while its stage actors are alive, has
headless chromium load the dashboard page and save a PNG (reduced to a palette so it stays
small). The throwaway Ray runs without token authentication (``RAY_AUTH_MODE=disabled``, this
process only): headless chromium cannot type the token into the dashboard's dialog.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

os.environ["RAY_AUTH_MODE"] = "disabled"  # before Ray starts; see the module's docstring

PAGES = {"actors": "#/actors", "overview": "#/overview", "cluster": "#/cluster", "jobs": "#/jobs"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shoot(url: str, out: str, chromium: str, size: tuple[int, int], wait_ms: int) -> None:
    """Save a PNG of ``url`` as headless chromium renders it after ``wait_ms`` of page time."""
    with tempfile.TemporaryDirectory(prefix="hpsray-chromium-") as profile:
        cmd = [
            chromium,
            "--headless",
            "--no-sandbox",  # root in a container
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={size[0]},{size[1]}",
            f"--virtual-time-budget={wait_ms}",
            f"--screenshot={out}",
            url,
        ]
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)


def shrink(path: str, colors: int = 96) -> None:
    """Palette PNG: a dashboard page has few colours, and the file drops to a fraction."""
    from PIL import Image

    Image.open(path).convert("RGB").quantize(colors=colors).save(path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/dashboard.png")
    parser.add_argument("--page", choices=sorted(PAGES), default="actors")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    parser.add_argument("--size", default="1700x780", help="window WIDTHxHEIGHT")
    parser.add_argument("--wait-ms", type=int, default=15_000, help="page time before the shot")
    args = parser.parse_args(argv)
    if not shutil.which(args.chromium):
        print(f"no {args.chromium}: apt-get install -y chromium", file=sys.stderr)
        return 2
    width, height = (int(v) for v in args.size.split("x"))

    import ray

    from hpsray.cluster.runtime import connect
    from hpsray.config import TrainConfig
    from hpsray.data import PlantedCTR
    from hpsray.pipelines import MemPSSettings, Pipeline, SyntheticSource, TrainerSettings

    port = _free_port()
    connect(None, include_dashboard=True, dashboard_port=port, log_to_driver=False)
    try:
        data = PlantedCTR(n_slots=8, keys_per_slot=20_000, n_dense=4, seed=0)
        config = TrainConfig(dim=8, hidden=(64, 32), minibatch_size=1000)
        with Pipeline(
            SyntheticSource(data, rows=40_000),
            TrainerSettings(config),
            MemPSSettings(capacity_rows=30_000),
            batch_size=4000,
            name="hpsray-demo",
        ) as pipe:
            report = pipe.fit(progress=False)
            time.sleep(5)  # the dashboard's state API catches up with the actors
            url = f"http://127.0.0.1:{port}/{PAGES[args.page]}"
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            shoot(url, args.out, args.chromium, (width, height), args.wait_ms)
    finally:
        ray.shutdown()
    shrink(args.out)
    print(f"{args.out}: {os.path.getsize(args.out) / 1024:.0f} KiB, {url}, run {report['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
