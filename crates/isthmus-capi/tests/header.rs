//! `include/isthmus.h` is what cbindgen makes of this crate now: a stale header fails here.
//! `ISTHMUS_BLESS=1 cargo test -p isthmus-capi --test header` rewrites it.

use std::path::Path;

#[test]
fn the_checked_in_header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml reads");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses the crate")
        .write(&mut generated);
    let path = dir.join("include/isthmus.h");
    if std::env::var_os("ISTHMUS_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("the header is written");
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "include/isthmus.h is stale: run `ISTHMUS_BLESS=1 cargo test -p isthmus-capi --test header` and commit it"
    );
}
