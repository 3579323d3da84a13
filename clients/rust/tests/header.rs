//! The checked-in header is what cbindgen makes of the C ABI today: a C program built
//! against it calls the functions the library exports, with the same types.

use std::path::Path;

#[test]
fn the_checked_in_header_matches_the_code() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).unwrap();
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_src(dir.join("src/capi.rs"))
        .with_src(dir.join("src/capi/zero_copy.rs"))
        .with_config(config)
        .generate()
        .expect("cbindgen reads src/capi.rs")
        .write(&mut generated);
    let path = dir.join("include/moongate_kv.h");
    if std::env::var_os("MOONGATE_WRITE_HEADER").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "{} is out of date with src/capi.rs: regenerate it with\n  \
         MOONGATE_WRITE_HEADER=1 cargo test -p moongate-kv --test header\n\
         --- generated ---\n{}",
        path.display(),
        String::from_utf8_lossy(&generated)
    );
}
