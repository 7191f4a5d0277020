//! The package test of `cargo xtask dist --test`: checks the agent's .deb the way dpkg, a
//! Debian archive and systemd would see it (members, owners and modes, control fields, the
//! unit against the binary's flags, `systemd-analyze verify`, lintian), and runs the binary
//! from the unpacked package.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail, ensure};

use crate::dist::deb::{
    self, ARCHITECTURE, BINARY_PATH, CONTENTS, MAINTAINER, MAINTAINER_SCRIPTS, Origin, PACKAGE,
    PRIORITY, SECTION, SOURCES, SUMMARY, UNIT_PATH,
};
use crate::dist::{ensure_static, output};

/// Flags the agent's `--help` must list: the ones the unit passes, and one more so that a
/// placeholder binary does not pass for the real one.
const HELP_MENTIONS: [&str; 4] = ["--config", "--state", "--log-format", "--hook"];

/// Runs the package checks; `work` is a scratch directory of its own.
pub(in crate::dist) fn test_package(
    root: &Path,
    work: &Path,
    deb: &Path,
    release: &Path,
    version: &str,
) -> Result<()> {
    if work.exists() {
        fs::remove_dir_all(work).with_context(|| format!("clear {}", work.display()))?;
    }
    fs::create_dir_all(work)?;
    let version = deb::debian_version(version);
    let name = deb.display();

    let fields = output(Command::new("dpkg-deb").arg("--field").arg(deb))?;
    control_verdict(&fields, &version).with_context(|| format!("{name}: control"))?;
    let info = output(Command::new("dpkg-deb").arg("--info").arg(deb))?;
    let control_members = output(
        Command::new("tar")
            .args(["--list", "--verbose", "--file", "-"])
            .stdin(dpkg_deb_stdout(deb, "--ctrl-tarfile")?),
    )?;
    control_members_verdict(&info, &control_members)
        .with_context(|| format!("{name}: control members"))?;
    let contents = output(Command::new("dpkg-deb").arg("--contents").arg(deb))?;
    contents_verdict(&contents).with_context(|| format!("{name}: contents"))?;

    let unpacked = work.join("root");
    output(
        Command::new("dpkg-deb")
            .arg("--extract")
            .arg(deb)
            .arg(&unpacked),
    )?;
    let control = work.join("control");
    output(
        Command::new("dpkg-deb")
            .arg("--control")
            .arg(deb)
            .arg(&control),
    )?;
    same_as_sources(root, release, &unpacked, &control)
        .with_context(|| format!("{name}: unpacked files"))?;
    output(
        Command::new("md5sum")
            .args(["--check", "--quiet", "--strict"])
            .arg(control.join("md5sums"))
            .current_dir(&unpacked),
    )
    .with_context(|| format!("{name}: DEBIAN/md5sums"))?;

    let binary = unpacked.join(BINARY_PATH);
    ensure_static(&binary)?;
    let help = output(Command::new(&binary).arg("--help").stdin(Stdio::null()))
        .with_context(|| format!("/{BINARY_PATH} --help from the unpacked package"))?;
    for flag in HELP_MENTIONS {
        ensure!(
            help.contains(flag),
            "/{BINARY_PATH} --help does not mention {flag}:\n{help}"
        );
    }
    let unit = fs::read_to_string(unpacked.join(UNIT_PATH))?;
    let exec_start = unit_verdict(&unit).with_context(|| format!("/{UNIT_PATH}"))?;
    // The unit's own arguments, then --help: clap parses (and validates) every one of them
    // before it prints the help, so an unknown flag or a bad value fails here.
    output(
        Command::new(&binary)
            .args(&exec_start[1..])
            .arg("--help")
            .stdin(Stdio::null()),
    )
    .with_context(|| format!("the agent does not take the arguments of /{UNIT_PATH}"))?;

    systemd_verify(&unpacked)?;
    lintian(deb)?;
    Ok(())
}

/// The stdout of `dpkg-deb <flag> <deb>` as a pipe for the next command.
fn dpkg_deb_stdout(deb: &Path, flag: &str) -> Result<Stdio> {
    let child = Command::new("dpkg-deb")
        .arg(flag)
        .arg(deb)
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("run dpkg-deb {flag}"))?;
    Ok(child.stdout.context("dpkg-deb stdout")?.into())
}

/// The fields of `dpkg-deb --field`, continuation lines joined to their field with `\n`.
fn fields(text: &str) -> Result<BTreeMap<String, String>> {
    let mut fields: BTreeMap<String, String> = BTreeMap::new();
    let mut last: Option<String> = None;
    for line in text.lines() {
        if line.starts_with([' ', '\t']) {
            let key = last
                .as_ref()
                .context("a continuation line opens the control")?;
            let value = fields.entry(key.clone()).or_default();
            value.push('\n');
            value.push_str(line.trim());
        } else if let Some((key, value)) = line.split_once(':') {
            ensure!(
                fields
                    .insert(key.to_owned(), value.trim().to_owned())
                    .is_none(),
                "field {key} appears twice"
            );
            last = Some(key.to_owned());
        } else if !line.is_empty() {
            bail!("not a control line: {line:?}");
        }
    }
    Ok(fields)
}

fn control_verdict(text: &str, version: &str) -> Result<()> {
    let fields = fields(text)?;
    for (key, want) in [
        ("Package", PACKAGE),
        ("Version", version),
        ("Architecture", ARCHITECTURE),
        ("Maintainer", MAINTAINER),
        ("Section", SECTION),
        ("Priority", PRIORITY),
    ] {
        let got = fields.get(key).map(String::as_str);
        ensure!(got == Some(want), "{key} is {got:?}, want {want:?}");
    }
    let description = fields.get("Description").context("no Description")?;
    let (summary, long) = description
        .split_once('\n')
        .context("no long description")?;
    ensure!(summary == SUMMARY, "Description starts {summary:?}");
    ensure!(long.len() > 200, "the long description is too short");
    let size: u64 = fields
        .get("Installed-Size")
        .context("no Installed-Size")?
        .parse()
        .context("Installed-Size is not a number of KiB")?;
    ensure!(
        size > 1000,
        "Installed-Size {size} KiB is too small for the binary"
    );
    if let Some(built_using) = fields.get("Built-Using") {
        ensure!(
            built_using.starts_with("glibc (= "),
            "Built-Using is {built_using:?}"
        );
    }
    let known = [
        "Package",
        "Version",
        "Architecture",
        "Maintainer",
        "Installed-Size",
        "Built-Using",
        "Section",
        "Priority",
        "Description",
    ];
    let extra: Vec<&String> = fields
        .keys()
        .filter(|key| !known.contains(&key.as_str()))
        .collect();
    ensure!(extra.is_empty(), "unexpected fields {extra:?}");
    Ok(())
}

/// One line of `tar --list --verbose` (which `dpkg-deb --contents` prints): mode string,
/// `owner/group` and path, with directories ending in `/`.
fn listing(text: &str) -> Result<BTreeMap<String, (String, String)>> {
    let mut entries = BTreeMap::new();
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        ensure!(words.len() == 6, "unexpected listing line {line:?}");
        let path = words[5].trim_start_matches('.').to_owned();
        entries.insert(path, (words[0].to_owned(), words[1].to_owned()));
    }
    Ok(entries)
}

fn mode_string(directory: bool, mode: u32) -> String {
    let mut text = String::from(if directory { "d" } else { "-" });
    for shift in [6, 3, 0] {
        let bits = mode >> shift & 0o7;
        text.push(if bits & 4 != 0 { 'r' } else { '-' });
        text.push(if bits & 2 != 0 { 'w' } else { '-' });
        text.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    text
}

/// What `dpkg-deb --contents` must show: [`CONTENTS`], the directories on their paths
/// (0755), everything root:root.
fn expected_contents() -> BTreeMap<String, (String, String)> {
    let owner = "root/root".to_owned();
    let mut wanted = BTreeMap::new();
    wanted.insert("/".to_owned(), (mode_string(true, 0o755), owner.clone()));
    for file in &CONTENTS {
        let mut dir = Path::new(file.path).parent();
        while let Some(at) = dir.filter(|at| !at.as_os_str().is_empty()) {
            let key = format!("/{}/", at.display());
            wanted.insert(key, (mode_string(true, 0o755), owner.clone()));
            dir = at.parent();
        }
        let key = format!("/{}", file.path);
        wanted.insert(key, (mode_string(false, file.mode), owner.clone()));
    }
    wanted
}

fn contents_verdict(contents: &str) -> Result<()> {
    let found = listing(contents)?;
    let wanted = expected_contents();
    ensure!(
        found == wanted,
        "dpkg-deb --contents shows\n{contents}\nwant exactly {wanted:#?}"
    );
    Ok(())
}

/// The control archive holds control, md5sums and the three maintainer scripts (0755), no
/// conffiles, all root:root; `dpkg-deb --info` lists the same.
fn control_members_verdict(info: &str, members: &str) -> Result<()> {
    let found = listing(members)?;
    let mut wanted = BTreeMap::new();
    wanted.insert(
        "/".to_owned(),
        (mode_string(true, 0o755), "root/root".to_owned()),
    );
    for name in ["control", "md5sums"] {
        wanted.insert(
            format!("/{name}"),
            (mode_string(false, 0o644), "root/root".to_owned()),
        );
    }
    for name in MAINTAINER_SCRIPTS {
        wanted.insert(
            format!("/{name}"),
            (mode_string(false, 0o755), "root/root".to_owned()),
        );
    }
    ensure!(
        found == wanted,
        "the control archive holds\n{members}\nwant exactly {wanted:#?}"
    );
    let listed: BTreeSet<&str> = info
        .lines()
        .filter(|line| line.contains(" bytes, "))
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let at = words.iter().position(|word| *word == "lines")?;
            words.get(at + 1).map(|name| match *name {
                "*" => words.get(at + 2).copied().unwrap_or_default(),
                name => name,
            })
        })
        .collect();
    let wanted: BTreeSet<&str> = ["control", "md5sums"]
        .into_iter()
        .chain(MAINTAINER_SCRIPTS)
        .collect();
    ensure!(
        listed == wanted,
        "dpkg-deb --info lists {listed:?}, want {wanted:?}:\n{info}"
    );
    for script in MAINTAINER_SCRIPTS {
        let executable = info
            .lines()
            .any(|line| line.contains(&format!("*  {script} ")) && line.contains("#!/bin/sh"));
        ensure!(
            executable,
            "dpkg-deb --info does not show {script} as an executable /bin/sh script:\n{info}"
        );
    }
    Ok(())
}

/// Every packaged file that is copied is byte for byte its source; the maintainer scripts too.
fn same_as_sources(root: &Path, release: &Path, unpacked: &Path, control: &Path) -> Result<()> {
    let sources = root.join(SOURCES);
    let mut pairs: Vec<(PathBuf, PathBuf)> = Vec::new();
    for file in &CONTENTS {
        match file.origin {
            Origin::Binary(name) => pairs.push((release.join(name), unpacked.join(file.path))),
            Origin::Source(name) => pairs.push((sources.join(name), unpacked.join(file.path))),
            Origin::Changelog | Origin::Manual => {}
        }
    }
    for script in MAINTAINER_SCRIPTS {
        pairs.push((sources.join(script), control.join(script)));
    }
    for (source, packaged) in pairs {
        let same = fs::read(&source).with_context(|| format!("read {}", source.display()))?
            == fs::read(&packaged).with_context(|| format!("read {}", packaged.display()))?;
        ensure!(
            same,
            "{} differs from {}",
            packaged.display(),
            source.display()
        );
    }
    Ok(())
}

/// The `key=value` settings of a unit file, by section; comments and blank lines skipped.
fn unit_settings(text: &str) -> Result<BTreeMap<(String, String), Vec<String>>> {
    let mut settings: BTreeMap<(String, String), Vec<String>> = BTreeMap::new();
    let mut section = String::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with(['#', ';']) {
            continue;
        }
        if let Some(name) = line
            .strip_prefix('[')
            .and_then(|rest| rest.strip_suffix(']'))
        {
            section = name.to_owned();
            continue;
        }
        ensure!(
            !line.ends_with('\\'),
            "continued lines are not expected: {line:?}"
        );
        let (key, value) = line
            .split_once('=')
            .context(format!("not a setting: {line:?}"))?;
        settings
            .entry((section.clone(), key.trim().to_owned()))
            .or_default()
            .push(value.trim().to_owned());
    }
    Ok(settings)
}

/// Checks the unit against the agent's conventions and returns its `ExecStart` as argv.
fn unit_verdict(text: &str) -> Result<Vec<String>> {
    let settings = unit_settings(text)?;
    let one = |section: &str, key: &str| -> Result<&str> {
        match settings
            .get(&(section.to_owned(), key.to_owned()))
            .map(Vec::as_slice)
        {
            Some([value]) => Ok(value.as_str()),
            Some(values) => bail!("[{section}] {key} is set {} times", values.len()),
            None => bail!("[{section}] has no {key}="),
        }
    };
    let argv: Vec<String> = one("Service", "ExecStart")?
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    ensure!(
        argv.first().map(String::as_str) == Some(&format!("/{BINARY_PATH}")),
        "ExecStart does not run /{BINARY_PATH}: {argv:?}"
    );
    let flag = |name: &str| -> Option<&str> {
        argv.windows(2)
            .find(|pair| pair[0] == name)
            .map(|pair| pair[1].as_str())
    };

    let config = flag("--config").unwrap_or("/etc/bigfleet-agent/config.json");
    let condition = one("Unit", "ConditionPathExists")?;
    ensure!(
        condition == config,
        "ConditionPathExists={condition} but the agent reads {config}"
    );
    let state_dir = format!("/var/lib/{}/", one("Service", "StateDirectory")?);
    let state = flag("--state").unwrap_or("/var/lib/bigfleet-agent/state.json");
    ensure!(
        state.starts_with(&state_dir) && !state[state_dir.len()..].contains('/'),
        "--state {state} is not in the StateDirectory {state_dir}"
    );
    ensure!(
        one("Service", "StateDirectoryMode")? == "0700",
        "the state directory must be 0700"
    );
    ensure!(
        flag("--log-format") == Some("json"),
        "ExecStart lacks --log-format json"
    );
    for (section, key, want) in [
        ("Service", "Restart", "on-failure"),
        ("Service", "StandardError", "journal"),
        ("Service", "NoNewPrivileges", "no"),
        ("Install", "WantedBy", "multi-user.target"),
    ] {
        let got = one(section, key)?;
        ensure!(got == want, "[{section}] {key}={got}, want {want}");
    }
    one("Service", "RestartSec")?;
    Ok(argv)
}

/// `systemd-analyze verify` of the unit inside the unpacked tree, so that it finds the
/// packaged binary. Only this unit is checked (`--recursive-errors=no`): the tree holds none
/// of the targets it refers to.
fn systemd_verify(unpacked: &Path) -> Result<()> {
    if Command::new("systemd-analyze")
        .arg("--version")
        .stdout(Stdio::null())
        .status()
        .is_err()
    {
        println!(
            "dist: systemd-analyze not found, unit not verified (deploy/ci-setup.sh installs it)"
        );
        return Ok(());
    }
    let done = Command::new("systemd-analyze")
        .args(["verify", "--recursive-errors=no", "--man=no"])
        .arg(format!("--root={}", unpacked.display()))
        .arg(format!("/{UNIT_PATH}"))
        .stdin(Stdio::null())
        .output()
        .context("run systemd-analyze verify")?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&done.stdout),
        String::from_utf8_lossy(&done.stderr)
    );
    // It reports some problems (an unknown key, a bad value) only as a message.
    ensure!(
        done.status.success() && said.trim().is_empty(),
        "systemd-analyze verify /{UNIT_PATH} ({}):\n{said}",
        done.status
    );
    Ok(())
}

/// lintian with Debian's default profile: no error and no warning (overrides, with their
/// reasons, are in deploy/digitalocean/deb/lintian-overrides); informational tags are shown.
fn lintian(deb: &Path) -> Result<()> {
    let done = Command::new("lintian")
        .args(["--fail-on", "error,warning", "--info", "--display-info"])
        .arg(deb)
        .stdin(Stdio::null())
        .output()
        .context("run lintian (install it with deploy/ci-setup.sh)")?;
    let said = String::from_utf8_lossy(&done.stdout);
    ensure!(
        done.status.success(),
        "lintian {} ({}):\n{said}{}",
        deb.display(),
        done.status,
        String::from_utf8_lossy(&done.stderr)
    );
    for line in said.lines().filter(|line| !line.starts_with("N:")) {
        println!("dist: lintian: {line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn committed_unit() -> String {
        fs::read_to_string(
            crate::repo::root()
                .join(SOURCES)
                .join("bigfleet-agent.service"),
        )
        .unwrap()
    }

    #[test]
    fn the_committed_unit_fits_the_agent() {
        let argv = unit_verdict(&committed_unit()).unwrap();
        assert_eq!(argv[0], "/usr/bin/bigfleet-agent");
    }

    #[test]
    fn unit_mistakes_are_caught() {
        let unit = committed_unit();
        for (from, to) in [
            (
                "--state /var/lib/bigfleet-agent/",
                "--state /var/lib/other/",
            ),
            (
                "ConditionPathExists=/etc/bigfleet-agent/config.json",
                "ConditionPathExists=/x",
            ),
            ("--log-format json", "--log-format text"),
            ("Restart=on-failure", "Restart=always"),
            ("StateDirectory=bigfleet-agent", "StateDirectory=other"),
            ("ExecStart=/usr/bin/", "ExecStart=/usr/local/bin/"),
            ("NoNewPrivileges=no", "NoNewPrivileges=yes"),
            ("RestartSec=5s", "#"),
            ("Restart=on-failure", "Restart=on-failure\nRestart=always"),
        ] {
            assert!(unit.contains(from), "{from}");
            let broken = unit.replacen(from, to, 1);
            assert!(unit_verdict(&broken).is_err(), "{from} -> {to} passed");
        }
    }

    #[test]
    fn control_checks() {
        let text = deb::control("0.1.0", 11_000, Some("glibc (= 2.36-9+deb12u14)"));
        control_verdict(&text, "0.1.0").unwrap();
        assert!(control_verdict(&text, "0.2.0").is_err());
        let amd = text.replace("Architecture: amd64", "Architecture: all");
        assert!(control_verdict(&amd, "0.1.0").is_err());
        let extra = format!("{text}Depends: libc6\n");
        assert!(control_verdict(&extra, "0.1.0").is_err());
        let tiny = text.replace("Installed-Size: 11000", "Installed-Size: 3");
        assert!(control_verdict(&tiny, "0.1.0").is_err());
    }

    #[test]
    fn contents_must_match_exactly() {
        let mut listing = String::new();
        for (path, (mode, owner)) in expected_contents() {
            listing.push_str(&format!("{mode} {owner} 0 2026-11-30 14:49 .{path}\n"));
        }
        contents_verdict(&listing).unwrap();
        let mode = listing.replace("-rwxr-xr-x root/root", "-rwxrwxr-x root/root");
        assert!(contents_verdict(&mode).is_err());
        let owner = listing.replacen("root/root", "user/user", 1);
        assert!(contents_verdict(&owner).is_err());
        let extra = format!("{listing}-rw-r--r-- root/root 0 2026-11-30 14:49 ./etc/x\n");
        assert!(contents_verdict(&extra).is_err());
        assert_eq!(mode_string(true, 0o755), "drwxr-xr-x");
        assert_eq!(mode_string(false, 0o644), "-rw-r--r--");
    }
}
