"""`streamer up` as a child process of a test: its output read as it comes, its /metrics scraped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path


class Up:
    """`streamer up --data-dir DATA_DIR --no-progress ARGS`. Its output is read as it comes and,
    once it names the /metrics URL, that page is scraped every second: the names of the series
    seen gather in ``series``. As a context manager: at exit the scraping stops, the child is
    killed (a no-op when it has exited) and its output is complete."""

    def __init__(self, data_dir: Path, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamer", "up", "--data-dir", str(data_dir), "--no-progress", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self.series: set[str] = set()
        self.stop = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def __enter__(self) -> Up:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.proc.kill()
        self.reader.join(5)

    def output(self) -> str:
        return "".join(self.lines)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := re.search(r"/metrics on (http://\S+/metrics)", line):
                threading.Thread(target=self._scrape, args=(m.group(1),), daemon=True).start()

    def _scrape(self, url: str) -> None:
        while not self.stop.is_set():
            try:
                text = urllib.request.urlopen(url, timeout=2).read().decode()
            except OSError:
                text = ""
            self.series |= {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and ln[0] != "#"}
            self.stop.wait(1.0)
