"""Every environment knob kvmesh reads, typed, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def kvmesh_home() -> Path:
    """Cache root for fetched models (`$KVMESH_HOME`, default `~/.cache/kvmesh`)."""
    return Path(os.environ.get("KVMESH_HOME", Path.home() / ".cache" / "kvmesh")).expanduser()


def kernels_dir() -> Path:
    """Where the C++ CPU kernels are built, one folder per source hash (`$KVMESH_KERNELS_DIR`,
    default `$KVMESH_HOME/kernels`)."""
    value = os.environ.get("KVMESH_KERNELS_DIR")
    return Path(value).expanduser() if value else kvmesh_home() / "kernels"


def num_threads() -> int | None:
    """Torch intra-op threads (`KVMESH_NUM_THREADS`); None: see serve_threads."""
    value = os.environ.get("KVMESH_NUM_THREADS")
    return int(value) if value else None


def load_threads() -> int | None:
    """Torch threads while an engine loads its model and KV pool (`KVMESH_LOAD_THREADS`);
    None: the serving threads (see num_threads)."""
    value = os.environ.get("KVMESH_LOAD_THREADS")
    return int(value) if value else None


def log_level() -> str:
    return os.environ.get("KVMESH_LOG_LEVEL", "WARNING").upper()


def log_json() -> bool:
    return os.environ.get("KVMESH_LOG_JSON", "1") not in ("0", "false", "")


def model_cache() -> bool:
    """Keep converted models (and GGUF tokenizers) under $KVMESH_HOME/cache
    (`KVMESH_MODEL_CACHE`, default on; 0 converts the source at every start)."""
    return os.environ.get("KVMESH_MODEL_CACHE", "1") not in ("0", "false", "off", "")


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as taskset and cgroups write it: `0`, `0-1`, `0,2-3`; ValueError when malformed
    or empty."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        low, dash, high = part.partition("-")
        high = high if dash else low
        if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
            raise ValueError(f"expected a CPU list like 0, 0-1 or 0,2-3, got {text!r}")
        cpus.update(range(int(low), int(high) + 1))
    return frozenset(cpus)


def worker_cpus() -> str | None:
    """The CPU list a worker pins itself to when it starts (`KVMESH_CPUS`, e.g. `0` or `0-1`;
    set by `kvmesh serve prefill|decode --cpus` and per role by `kvmesh up`); None: every CPU it
    was started with."""
    return os.environ.get("KVMESH_CPUS", "").strip() or None


def role_cpus(role: str) -> str | None:
    """`kvmesh up`: the CPU list of every worker of `role` (`KVMESH_PREFILL_CPUS`,
    `KVMESH_DECODE_CPUS`; set by --prefill-cpus / --decode-cpus); None: not pinned."""
    return os.environ.get(f"KVMESH_{role.upper()}_CPUS", "").strip() or None


def lead_cpu() -> int | None:
    """The CPU a worker's engine thread keeps to itself (`KVMESH_LEAD_CPU`; `kvmesh up` sets it
    for a lone decode worker: mesh/affinity.py); None: it shares the process's CPUs."""
    text = os.environ.get("KVMESH_LEAD_CPU", "").strip()
    if text and not text.isdigit():
        raise ValueError(f"KVMESH_LEAD_CPU must be a CPU number, got {text!r}")
    return int(text) if text else None


def serve_threads() -> int:
    """Torch intra-op threads while serving: `KVMESH_NUM_THREADS`, else one per CPU this process
    may run on now (its affinity: torch fixes its own default when it loads, so a process pinned
    after importing torch would keep a pool sized for the CPUs it had before), counting the
    engine thread's lead CPU."""
    lead = lead_cpu()
    return num_threads() or len(os.sched_getaffinity(0) | ({lead} if lead is not None else set()))


def cpu_kernels() -> bool:
    """Use the C++ CPU kernels where the CPU can run them (`KVMESH_KERNELS`, default on)."""
    return os.environ.get("KVMESH_KERNELS", "1") not in ("0", "false", "off", "")


def kernels_isa() -> str | None:
    """The instruction set the CPU kernels are built for (`KVMESH_KERNELS_ISA`, "avx512" or
    "avx2"; unset: the best this CPU runs). avx2 on an AVX-512 CPU runs the AVX2 kernels there."""
    return os.environ.get("KVMESH_KERNELS_ISA") or None


def amx_kernels() -> bool:
    """Use the AMX linear kernel where the CPU has AMX (`KVMESH_AMX`, default on). Off too when
    `ONEDNN_MAX_CPU_ISA` caps oneDNN below AMX, so that one variable takes every AMX path away."""
    if os.environ.get("KVMESH_AMX", "1") in ("0", "false", "off", ""):
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return not cap or "AMX" in cap or cap in ("ALL", "DEFAULT")


def event_loop() -> str:
    """The asyncio loop of every service and benchmark client (`KVMESH_EVENT_LOOP`): `uvloop`
    (default, where installed) or `asyncio` (the standard library's)."""
    value = os.environ.get("KVMESH_EVENT_LOOP", "uvloop").strip().lower() or "uvloop"
    if value not in ("uvloop", "asyncio"):
        raise ValueError(f"KVMESH_EVENT_LOOP must be uvloop or asyncio, got {value!r}")
    return value


API_KEYS_ENV = "KVMESH_API_KEYS"  # the gateway's keys, one per line (how `kvmesh up` passes them)


def api_keys() -> list[str]:
    """Keys from `$KVMESH_API_KEYS` (one per line; blank lines skipped)."""
    return [line.strip() for line in os.environ.get(API_KEYS_ENV, "").splitlines() if line.strip()]


ETCD_PASSWORD_ENV = "KVMESH_ETCD_PASSWORD"  # the password of --etcd-user (kept off argv)


def take_etcd_password() -> str | None:
    """The password of --etcd-user, removed from the environment (child processes have no use
    for it)."""
    return os.environ.pop(ETCD_PASSWORD_ENV, None) or None


TLS_ENV = ("KVMESH_TLS_CERT", "KVMESH_TLS_KEY", "KVMESH_TLS_CA")  # defaults of --tls-cert/key/ca


def tls_paths() -> tuple[str | None, str | None, str | None]:
    """(cert, key, ca) from the environment: the --tls-* defaults, and what a container's health
    check (kvmesh_apps.deploy.probe) dials its service with."""
    return tuple(os.environ.get(name) or None for name in TLS_ENV)  # type: ignore[return-value]
