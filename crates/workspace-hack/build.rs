//! Empty: cargo resolves `[build-dependencies]` (and so unifies their features) only for a
//! package with a build script.

fn main() {}
