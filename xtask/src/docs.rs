//! `cargo xtask docs [--update]`: keeps the flag table of each provider's
//! `docs/<binary>/configuration.md` identical to what the binary's `--help` says. The table
//! sits between `<!-- flags:begin -->` and `<!-- flags:end -->`; `--update` rewrites it, the
//! plain run fails when it is stale.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, bail};

use crate::repo;

const BEGIN: &str = "<!-- flags:begin -->";
const END: &str = "<!-- flags:end -->";
const BINARIES: [&str; 2] = ["hetzner", "digitalocean"];

/// One option as `--help` describes it.
#[derive(Debug, PartialEq)]
struct Flag {
    name: String,
    default: String,
    env: String,
    about: String,
}

fn take_bracket(text: &mut String, key: &str) -> String {
    let marker = format!("[{key}: ");
    let Some(start) = text.find(&marker) else {
        return String::new();
    };
    let Some(len) = text[start..].find(']') else {
        return String::new();
    };
    let value = text[start + marker.len()..start + len].to_owned();
    text.replace_range(start..start + len + 1, "");
    value
}

/// Parses clap's long help: an option line (`--name <VALUE>`) followed by its description.
fn parse_help(help: &str) -> Vec<Flag> {
    let mut flags: Vec<Flag> = Vec::new();
    let mut in_options = false;
    let mut description = String::new();
    let finish = |flags: &mut Vec<Flag>, description: &mut String| {
        if let Some(last) = flags.last_mut() {
            let mut text = description.trim().to_owned();
            last.env = take_bracket(&mut text, "env");
            last.default = take_bracket(&mut text, "default");
            last.about = text.split_whitespace().collect::<Vec<_>>().join(" ");
        }
        description.clear();
    };
    for line in help.lines() {
        if line.starts_with("Options:") {
            in_options = true;
            continue;
        }
        if !in_options {
            continue;
        }
        let trimmed = line.trim_start();
        let is_option =
            trimmed.starts_with("--") || (trimmed.starts_with('-') && trimmed.contains(", --"));
        if is_option && line.len() - trimmed.len() <= 6 {
            finish(&mut flags, &mut description);
            let long = trimmed.split("--").nth(1).unwrap_or_default();
            let name: String = long
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            flags.push(Flag {
                name,
                default: String::new(),
                env: String::new(),
                about: String::new(),
            });
        } else {
            description.push(' ');
            description.push_str(trimmed);
        }
    }
    finish(&mut flags, &mut description);
    flags.retain(|f| f.name != "help" && f.name != "version");
    flags
}

fn render(flags: &[Flag]) -> String {
    let mut out = String::from("| Flag | Default | Environment | Meaning |\n|---|---|---|---|\n");
    for f in flags {
        let default = match f.default.as_str() {
            "" | "\"\"" => "(empty)".to_owned(),
            d => format!("`{d}`"),
        };
        let env = if f.env.is_empty() {
            String::new()
        } else {
            format!("`{}`", f.env)
        };
        out.push_str(&format!(
            "| `--{}` | {default} | {env} | {} |\n",
            f.name,
            f.about.replace('|', "\\|")
        ));
    }
    out
}

fn splice(doc: &str, table: &str) -> Option<String> {
    let start = doc.find(BEGIN)? + BEGIN.len();
    let end = doc.find(END)?;
    (start <= end).then(|| format!("{}\n{}{}", &doc[..start], table, &doc[end..]))
}

fn help_of(root: &Path, binary: &str) -> anyhow::Result<String> {
    let exe = root.join("target/debug").join(binary);
    let out = Command::new(&exe)
        .arg("--help")
        .output()
        .with_context(|| format!("run {}", exe.display()))?;
    if !out.status.success() {
        bail!("{binary} --help failed");
    }
    Ok(String::from_utf8(out.stdout)?)
}

pub fn run(args: &[String]) -> anyhow::Result<()> {
    let update = args.iter().any(|a| a == "--update");
    let root = repo::root();
    let status = Command::new(env!("CARGO"))
        .current_dir(&root)
        .args(["build", "--quiet", "-p", "hetzner", "-p", "digitalocean"])
        .status()?;
    if !status.success() {
        bail!("building the binaries failed");
    }
    let mut stale = Vec::new();
    for binary in BINARIES {
        let path = root.join("docs").join(binary).join("configuration.md");
        let doc =
            std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        let table = render(&parse_help(&help_of(&root, binary)?));
        let Some(fresh) = splice(&doc, &table) else {
            bail!("{} has no {BEGIN} ... {END} markers", path.display());
        };
        if fresh != doc {
            if update {
                std::fs::write(&path, fresh)?;
                println!("updated {}", path.display());
            } else {
                stale.push(path.display().to_string());
            }
        }
    }
    if !stale.is_empty() {
        bail!(
            "flag tables out of date with --help: {} (run `cargo xtask docs --update`)",
            stale.join(", ")
        );
    }
    println!("docs: flag tables match --help");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HELP: &str = "Usage: x [OPTIONS]\n\nOptions:\n      --addr <ADDR>\n          gRPC listen address [default: :9000]\n      --token <TOKEN>\n          API token [env: HCLOUD_TOKEN]\n      --reflection[=<REFLECTION>]\n          Register reflection\n          over two lines [default: true]\n  -h, --help\n          Print help\n";

    #[test]
    fn parses_clap_help() {
        let flags = parse_help(HELP);
        assert_eq!(flags.len(), 3);
        assert_eq!(
            flags[0],
            Flag {
                name: "addr".into(),
                default: ":9000".into(),
                env: String::new(),
                about: "gRPC listen address".into()
            }
        );
        assert_eq!(flags[1].env, "HCLOUD_TOKEN");
        assert_eq!(flags[2].about, "Register reflection over two lines");
        assert_eq!(flags[2].default, "true");
    }

    #[test]
    fn a_stale_table_is_detected() {
        let table = render(&parse_help(HELP));
        let doc = format!("intro\n{BEGIN}\n{table}{END}\nrest\n");
        assert_eq!(
            splice(&doc, &table).as_deref(),
            Some(doc.as_str()),
            "fresh table: no change"
        );
        let edited = doc.replace(":9000", ":9999");
        assert_ne!(
            splice(&edited, &table).as_deref(),
            Some(edited.as_str()),
            "an edited default is caught"
        );
        assert_eq!(splice("no markers", &table), None);
    }
}
