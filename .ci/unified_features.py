#!/usr/bin/env python3
"""Checks that the packages `make` builds on their own share the test build's dependencies.

`make test` builds the C library (`cargo build -p isthmus-capi`), the Python extension
(maturin: `cargo rustc -p isthmus-python --lib`) and the sidecar (`cargo build -p
gateway-sidecar`) besides `cargo test --workspace`. A dependency compiled differently in two of
them is compiled twice, and with it everything above it. Two causes were seen:

- features: cargo resolves them per invocation; crates/workspace-hack asks for the union;
- profile: a crate that is only a proc macro's dependency in one build (host code, which gets
  `build-override` settings) and also a test's in the other (syn, through cbindgen) was built
  with different debug info, and everything above it twice; `[profile.dev.build-override]`
  matches the two.

A unit counts as shared when the test build has one with the same package, target, features,
profile (but for its name: `test` inherits `dev`) and, recursively, dependencies. This names each
unit that differs while its dependencies do not (the root of a rebuild), and what differs.

It reads cargo's unit graph (`--unit-graph`, unstable, hence RUSTC_BOOTSTRAP), which resolves
without compiling: a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

# The builds that must reuse the test build's units, as make runs them.
BUILDS = [
    ["build", "-p", "isthmus-capi"],
    ["rustc", "-p", "isthmus-python", "--lib"],
    ["build", "-p", "gateway-sidecar"],
]
TEST_BUILD = ["test", "--workspace", "--no-run"]

Unit = dict[str, Any]


class Graph:
    """One build's units, each with a key that equals another build's when cargo would reuse it."""

    def __init__(self, args: list[str]) -> None:
        env = dict(os.environ, RUSTC_BOOTSTRAP="1")
        out = subprocess.run(
            ["cargo", *args, "--unit-graph", "-Z", "unstable-options"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if out.returncode != 0:
            sys.exit(f"cargo {' '.join(args)} --unit-graph failed:\n{out.stderr}")
        self.units: list[Unit] = json.loads(out.stdout)["units"]
        self.keys: dict[int, str] = {}
        for i in range(len(self.units)):
            self.key(i)

    @staticmethod
    def own(u: Unit) -> tuple[str, ...]:
        profile = {k: v for k, v in u["profile"].items() if k != "name"}
        return (
            u["pkg_id"],
            u["mode"],
            u["target"]["name"],
            ",".join(u["target"]["kind"]),
            ",".join(u["features"]),
            json.dumps(profile, sort_keys=True),
        )

    def key(self, i: int) -> str:
        if i not in self.keys:
            u = self.units[i]
            deps = sorted(self.key(d["index"]) for d in u["dependencies"])
            self.keys[i] = hashlib.sha256(json.dumps([self.own(u), deps]).encode()).hexdigest()
        return self.keys[i]


def describe(u: Unit) -> str:
    return f"{u['pkg_id'].rsplit('#', 1)[-1]} ({u['mode']} {u['target']['name']})"


def main() -> int:
    test = Graph(TEST_BUILD)
    shared = set(test.keys.values())
    by_target: dict[tuple[str, str, str], list[Unit]] = {}
    for u in test.units:
        by_target.setdefault((u["pkg_id"], u["mode"], u["target"]["name"]), []).append(u)
    failed = False
    for args in BUILDS:
        build = Graph(args)
        for i, u in enumerate(build.units):
            if build.keys[i] in shared:
                continue
            # Only the root of a rebuild: above it, everything differs because it does.
            if any(build.keys[d["index"]] not in shared for d in u["dependencies"]):
                continue
            twins = by_target.get((u["pkg_id"], u["mode"], u["target"]["name"]), [])
            # A package the test build never compiles (pyo3, for one), or a target of a member's
            # own that it does not (the sidecar's binary), cannot be shared.
            if not twins:
                continue
            failed = True
            same_features = [t for t in twins if t["features"] == u["features"]]
            if same_features:
                diff = sorted(
                    f"{k} {v!r} (test build: {t['profile'].get(k)!r})"
                    for t in same_features
                    for k, v in u["profile"].items()
                    if k != "name" and t["profile"].get(k) != v
                )
                what = f"with profile settings {', '.join(diff)}"
                fix = "match them in Cargo.toml's profiles"
            else:
                want = sorted({f for t in twins for f in t["features"]})
                what = f"with features {u['features']}, the test build with {want}"
                fix = "give crates/workspace-hack the missing ones"
            print(f"cargo {' '.join(args)}: {describe(u)} is built {what}: {fix}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
