#!/usr/bin/env python3
"""Checks that the packages `make` builds on their own share the test build's dependencies.

`make test` builds the C library (`cargo build -p isthmus-capi`), the Python extension
(maturin: `cargo rustc -p isthmus-python --lib`) and the sidecar (`cargo build -p
gateway-sidecar`) besides `cargo test --workspace`. Cargo resolves features per invocation, so
a dependency whose features differ between them is compiled twice, and with it everything
above it. crates/workspace-hack asks for the union; this names any dependency that still
differs, and the feature to add there.

It reads cargo's unit graph (`--unit-graph`, unstable, hence RUSTC_BOOTSTRAP), which resolves
without compiling: a few seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# The builds that must reuse the test build's units, as make runs them.
BUILDS = [
    ["build", "-p", "isthmus-capi"],
    ["rustc", "-p", "isthmus-python", "--lib"],
    ["build", "-p", "gateway-sidecar"],
]
TEST_BUILD = ["test", "--workspace", "--no-run"]

Units = dict[tuple[str, str, str], set[tuple[str, ...]]]


def units(args: list[str]) -> Units:
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
    found: Units = {}
    for u in json.loads(out.stdout)["units"]:
        key = (u["pkg_id"], u["mode"], u["target"]["name"])
        found.setdefault(key, set()).add(tuple(sorted(u["features"])))
    return found


def main() -> int:
    shared = units(TEST_BUILD)
    packages = {pkg for pkg, _, _ in shared}
    failed = False
    for args in BUILDS:
        for (pkg, mode, target), features in sorted(units(args).items()):
            # A package the test build never compiles (pyo3, for one), or a target of a member's
            # own that it does not (the sidecar's binary), cannot be shared.
            if pkg not in packages or features <= shared.get((pkg, mode, target), set()):
                continue
            if pkg.startswith("path+") and (pkg, mode, target) not in shared:
                continue
            failed = True
            want = sorted({f for fs in shared.get((pkg, mode, target), set()) for f in fs})
            have = sorted({f for fs in features for f in fs})
            print(
                f"cargo {' '.join(args)}: {pkg} ({mode} {target}) is built with features "
                f"{have}, the test build with {want}: give crates/workspace-hack the missing ones"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
