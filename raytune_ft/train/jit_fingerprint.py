"""What a set of JIT caches was built for: the GPU model, the NVIDIA driver, the compilers' and kernel
libraries' versions, and the widths of the model it compiled kernels for. A set is loaded only where all of
them are the same (train/jit_cache.py); where one differs the set is named and left alone, because a
Triton binary or an Inductor graph built for another GPU or toolchain may load and compute wrongly.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

# the compilers, and the kernel libraries whose JIT output or autotune choices land in the caches
VERSIONED = ("torch", "triton", "flash-linear-attention", "fla-core", "tilelang", "causal-conv1d", "flash-attn",
             "liger-kernel", "torchao")
# the NVIDIA kernel module's own line; absent on a machine without the driver
_DRIVER_FILE = "/proc/driver/nvidia/version"


@dataclass(frozen=True)
class Fingerprint:
    """One set's key. `versions`: (package, version) pairs, sorted; "none" for a package not installed."""

    gpu: str                                   # torch's device name; "cpu" without a GPU
    driver: str                                # the NVIDIA driver's version; "none" without a GPU
    versions: tuple[tuple[str, str], ...]
    model: str                                 # the model's widths (model_widths)

    @property
    def name(self) -> str:
        """`<gpu>-<hash>`: the GPU's name, readable, and a hash of everything: the set's file name."""
        digest = hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:12]
        return f"{re.sub(r'[^a-z0-9]+', '-', self.gpu.lower()).strip('-')}-{digest}"

    def as_dict(self) -> dict:
        return {"gpu": self.gpu, "driver": self.driver, "versions": dict(self.versions), "model": self.model}

    @classmethod
    def from_dict(cls, d: dict) -> Fingerprint:
        """The fingerprint a set's JSON holds; ValueError when it is not one."""
        try:
            return cls(str(d["gpu"]), str(d["driver"]), tuple(sorted((str(k), str(v)) for k, v in d["versions"].items())),
                       str(d["model"]))
        except (KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"not a JIT cache fingerprint ({e!r})") from None

    def differences(self, built_for: Fingerprint) -> list[str]:
        """What a set built for `built_for` differs in from this node, in words: 'torch 2.11.0 (here 2.13.0)'."""
        out = [f"{what} {theirs!r} (here {mine!r})" for what, theirs, mine in
               (("GPU", built_for.gpu, self.gpu), ("driver", built_for.driver, self.driver),
                ("model", built_for.model, self.model)) if theirs != mine]
        mine, theirs = dict(self.versions), dict(built_for.versions)
        out += [f"{pkg} {theirs.get(pkg, 'none')} (here {mine.get(pkg, 'none')})"
                for pkg in sorted(set(mine) | set(theirs)) if mine.get(pkg, "none") != theirs.get(pkg, "none")]
        return out


def installed_versions() -> dict[str, str]:
    from raytune_ft.env import package_versions

    return package_versions(VERSIONED, "none")


def driver_version() -> str:
    """The NVIDIA driver's version from its kernel module's line; "none" without one."""
    try:
        with open(_DRIVER_FILE) as f:
            m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", f.read())
    except OSError:
        return "none"
    return m.group(1) if m else "unknown"


def fingerprint(device_name: str | None, versions: dict[str, str] | None = None, *, driver: str | None = None,
                model: str = "") -> Fingerprint:
    """This node's fingerprint: its GPU (None: a CPU worker), the installed packages' versions unless given,
    its driver unless given."""
    versions = installed_versions() if versions is None else versions
    if driver is None:
        driver = driver_version() if device_name else "none"
    return Fingerprint(device_name or "cpu", driver, tuple(sorted(versions.items())), model)


def model_widths(recipe) -> str:
    """The widths a run's kernels compile for (not its depth: a cut of the model shares the set); the model's
    name where its shape is not known before it is built."""
    try:
        from raytune_ft.planning.shapes import model_shape

        s, _ = model_shape(recipe)
    except Exception:  # noqa: BLE001 - an unknown model still gets a set of its own
        return recipe.model.name
    text = f"{s.family} hidden {s.hidden} mlp {s.intermediate} attention {s.heads}/{s.kv_heads}x{s.head_dim}"
    if s.lin_v_heads:
        text += f" gated-delta {s.lin_k_heads}x{s.lin_k_dim}/{s.lin_v_heads}x{s.lin_v_dim} conv {s.conv_kernel}"
    return f"{text} vocab {s.vocab}"
