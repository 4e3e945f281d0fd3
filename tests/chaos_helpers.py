"""Helpers shared by the chaos and launcher tests."""

from __future__ import annotations

import os

import psutil


def leftovers(job: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            env = p.info["environ"] or {}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if p.pid != os.getpid() and (f"--job {job}" in cmd or env.get("PSD_JOB") == job):
            found.append(f"{p.pid}: {cmd}")
    return found
