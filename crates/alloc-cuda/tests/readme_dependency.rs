//! The dependency lines the documentation shows resolve today: the crates
//! are not on crates.io yet, so each names the repository (`git = ...`) or
//! a clone (`path = ...`), never a version alone.

use std::path::Path;

#[test]
fn documented_dependency_lines_name_the_repository_or_a_path() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut readmes = vec![root.join("README.md")];
    for entry in std::fs::read_dir(root.join("crates")).expect("the crates folder") {
        let readme = entry.expect("a crate folder").path().join("README.md");
        if readme.exists() {
            readmes.push(readme);
        }
    }
    let git = format!("git = \"{}\"", env!("CARGO_PKG_REPOSITORY"));
    let mut lines = 0;
    for readme in readmes {
        let text = std::fs::read_to_string(&readme).expect("a readable README");
        let mut in_toml = false;
        for line in text.lines() {
            if let Some(fence) = line.trim().strip_prefix("```") {
                in_toml = !in_toml && fence == "toml";
                continue;
            }
            if in_toml && line.starts_with("alloc-") && line.contains(" = ") {
                lines += 1;
                assert!(
                    line.contains(&git) || line.contains("path = "),
                    "{}: `{line}` names neither {git} nor a path",
                    readme.display()
                );
            }
        }
    }
    assert!(lines >= 3, "only {lines} dependency lines found");
}
