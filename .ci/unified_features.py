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

It also checks that code which runs only while building (proc macros, build scripts and what only
they use) is compiled unoptimised, as Cargo.toml's `[profile.dev.package]` list asks: a
dependency added or renamed under a proc macro would otherwise be optimised by the `"*"` entry,
which outranks `build-override`, and make every cold build slower without failing anything.

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
        graph = json.loads(out.stdout)
        self.units: list[Unit] = graph["units"]
        self.roots: list[int] = graph["roots"]
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


def package(u: Unit) -> str:
    """The unit's package name, from its id (`…#name@1.2.3`, or `…/name#1.2.3` for a path)."""
    source, _, version = u["pkg_id"].rpartition("#")
    return version.split("@")[0] if "@" in version else source.rstrip("/").rsplit("/", 1)[-1]


def build_time(u: Unit) -> bool:
    """A unit that runs in the compiler's process or before it: a proc macro, a build script."""
    return u["mode"] == "build" and any(k in ("proc-macro", "custom-build") for k in u["target"]["kind"])


def runtime_packages(graph: Graph) -> set[str]:
    """The packages some root of the build uses other than through build-time code."""
    found: set[str] = set()
    seen: set[int] = set()
    stack = list(graph.roots)
    while stack:
        i = stack.pop()
        if i in seen or build_time(graph.units[i]):
            continue
        seen.add(i)
        found.add(package(graph.units[i]))
        stack.extend(d["index"] for d in graph.units[i]["dependencies"])
    return found


def optimised_build_time_code(graphs: list[tuple[list[str], Graph]]) -> bool:
    """Names each compiled unit of a package that no build uses but through build-time code and
    that is not at opt-level 0 (a profile setting is per package name: one that also runs in a
    test, such as the .proto reader the C ABI has, stays optimised); whether there was any."""
    runtime = set().union(*(runtime_packages(g) for _, g in graphs))
    named: set[str] = set()
    for args, graph in graphs:
        for u in graph.units:
            name = package(u)
            if name in runtime or name in named or u["mode"] != "build" or u["profile"]["opt_level"] == "0":
                continue
            named.add(name)
            print(
                f"cargo {' '.join(args)}: {describe(u)} only runs while building but is optimised: "
                f"add `{name} = {{ opt-level = 0 }}` to Cargo.toml's [profile.dev.package]"
            )
    return bool(named)


def main() -> int:
    test = Graph(TEST_BUILD)
    builds = [(args, Graph(args)) for args in BUILDS]
    failed = optimised_build_time_code([(TEST_BUILD, test), *builds])
    shared = set(test.keys.values())
    by_target: dict[tuple[str, str, str], list[Unit]] = {}
    for u in test.units:
        by_target.setdefault((u["pkg_id"], u["mode"], u["target"]["name"]), []).append(u)
    for args, build in builds:
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
