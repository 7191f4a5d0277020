//! The Debian package of `bigfleet-agent` that `cargo xtask dist` builds beside the images:
//! the static binary, the systemd unit and maintainer scripts of `deploy/digitalocean/deb`, a
//! man page made from `--help`, put together with plain `dpkg-deb` (no debhelper, no
//! cargo-deb, nothing beyond what every Debian system has).
//!
//! The package is reproducible: owners are root:root (`--root-owner-group`, no fakeroot), and
//! every timestamp, the changelog's included, is `SOURCE_DATE_EPOCH` or else the time of the
//! commit the tree is at.

use std::fmt::Write as _;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, ensure};

use super::{install, output};

pub(crate) const PACKAGE: &str = "bigfleet-agent";
pub(crate) const ARCHITECTURE: &str = "amd64";
/// Who answers for the package, in the `Maintainer` field and the changelog.
pub(crate) const MAINTAINER: &str = "BigFleet providers maintainers <bigfleet@example.org>";
pub(crate) const SECTION: &str = "admin";
pub(crate) const PRIORITY: &str = "optional";
pub(crate) const SUMMARY: &str = "BigFleet on-host agent for DigitalOcean Droplets";
const DESCRIPTION: &str = "\
The agent runs as root on every Droplet that the BigFleet DigitalOcean capacity
provider creates. It long-polls the provider over HTTPS (TLS 1.3, trusting only
the certificate the provider pinned in the Droplet's user_data), runs the
bootstrap hook that joins the Droplet to a cluster, confirms readiness, drains
the node before it goes, and reports each outcome back. A command it has run is
recorded and never run twice.
The systemd unit starts the agent once the provider's user_data has written
/etc/bigfleet-agent/config.json; logs go to the journal.";

/// Where the packaging sources live in the repository.
pub(crate) const SOURCES: &str = "deploy/digitalocean/deb";
pub(crate) const UNIT_PATH: &str = "lib/systemd/system/bigfleet-agent.service";
pub(crate) const BINARY_PATH: &str = "usr/bin/bigfleet-agent";
/// The maintainer scripts, all in `deploy/digitalocean/deb` under the same name.
pub(crate) const MAINTAINER_SCRIPTS: [&str; 3] = ["postinst", "prerm", "postrm"];

/// Where one file of the package comes from.
pub(crate) enum Origin {
    /// The release binary of this name.
    Binary(&'static str),
    /// A file under [`SOURCES`], copied as it is.
    Source(&'static str),
    /// The Debian changelog, made for this version and compressed.
    Changelog,
    /// The man page, made from the binary's `--help` and compressed.
    Manual,
}

pub(crate) struct Packaged {
    /// Path inside the package, without the leading `/`.
    pub(crate) path: &'static str,
    pub(crate) mode: u32,
    pub(crate) origin: Origin,
}

/// Every file of the package; the directories are those on their paths, and nothing else is
/// in it. There is no conffile: the config comes from user_data, and the unit is changed
/// with drop-ins (`systemctl edit`), not by editing the packaged file.
pub(crate) const CONTENTS: [Packaged; 6] = [
    Packaged {
        path: BINARY_PATH,
        mode: 0o755,
        origin: Origin::Binary("bigfleet-agent"),
    },
    Packaged {
        path: UNIT_PATH,
        mode: 0o644,
        origin: Origin::Source("bigfleet-agent.service"),
    },
    Packaged {
        path: "usr/share/doc/bigfleet-agent/changelog.gz",
        mode: 0o644,
        origin: Origin::Changelog,
    },
    Packaged {
        path: "usr/share/doc/bigfleet-agent/copyright",
        mode: 0o644,
        origin: Origin::Source("copyright"),
    },
    Packaged {
        path: "usr/share/lintian/overrides/bigfleet-agent",
        mode: 0o644,
        origin: Origin::Source("lintian-overrides"),
    },
    Packaged {
        path: "usr/share/man/man1/bigfleet-agent.1.gz",
        mode: 0o644,
        origin: Origin::Manual,
    },
];

/// The package's version: the workspace version, with a pre-release marked by `~` so that
/// `0.2.0-rc.1` sorts before `0.2.0` (and a `-` never reads as a Debian revision).
pub(crate) fn debian_version(cargo_version: &str) -> String {
    cargo_version.replace('-', "~")
}

pub(crate) fn file_name(version: &str) -> String {
    format!("{PACKAGE}_{}_{ARCHITECTURE}.deb", debian_version(version))
}

/// Builds `<dist>/bigfleet-agent_<version>_amd64.deb` from the release binaries in `release`
/// and returns its path. The tree it packs is left in `<dist>/deb/tree` for inspection.
pub(super) fn build(root: &Path, dist: &Path, release: &Path, version: &str) -> Result<PathBuf> {
    let tree = dist.join("deb").join("tree");
    if tree.exists() {
        fs::remove_dir_all(&tree).with_context(|| format!("clear {}", tree.display()))?;
    }
    let sources = root.join(SOURCES);
    let epoch = source_date_epoch(root)?;
    let version = debian_version(version);

    for file in &CONTENTS {
        let to = tree.join(file.path);
        match file.origin {
            Origin::Binary(name) => install(&release.join(name), &to, file.mode)?,
            Origin::Source(name) => install(&sources.join(name), &to, file.mode)?,
            Origin::Changelog => write(&to, &gzip(changelog(&version, epoch).as_bytes())?, 0o644)?,
            Origin::Manual => {
                let help = output(Command::new(release.join(PACKAGE)).arg("--help"))?;
                write(&to, &gzip(manual(&help, &version)?.as_bytes())?, 0o644)?;
            }
        }
    }
    let debian = tree.join("DEBIAN");
    for script in MAINTAINER_SCRIPTS {
        install(&sources.join(script), &debian.join(script), 0o755)?;
    }
    let md5sums = output(
        Command::new("md5sum")
            .current_dir(&tree)
            .args(CONTENTS.iter().map(|file| file.path)),
    )?;
    write(&debian.join("md5sums"), md5sums.as_bytes(), 0o644)?;
    let control = control(&version, installed_size(&tree)?, built_using().as_deref());
    write(&debian.join("control"), control.as_bytes(), 0o644)?;
    // Directories get 0755 whatever the umask; dpkg-deb insists on it for DEBIAN.
    for dir in directories_under(&tree)? {
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755))?;
    }

    let deb = dist.join(file_name(&version));
    output(
        Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz", "--build"])
            .arg(&tree)
            .arg(&deb)
            .env("SOURCE_DATE_EPOCH", epoch.to_string())
            .stdin(Stdio::null()),
    )
    .context("dpkg-deb --build (dpkg-deb comes with dpkg)")?;
    Ok(deb)
}

pub(crate) fn control(version: &str, installed_kib: u64, built_using: Option<&str>) -> String {
    let mut text = format!(
        "Package: {PACKAGE}\nVersion: {version}\nArchitecture: {ARCHITECTURE}\n\
         Maintainer: {MAINTAINER}\nInstalled-Size: {installed_kib}\n"
    );
    // Statically linked: the binary carries glibc, whose source Debian's policy (7.8) wants
    // named for a binary that embeds it.
    if let Some(built_using) = built_using {
        let _ = writeln!(text, "Built-Using: {built_using}");
    }
    let _ = writeln!(
        text,
        "Section: {SECTION}\nPriority: {PRIORITY}\nDescription: {SUMMARY}"
    );
    for line in DESCRIPTION.lines() {
        let _ = writeln!(text, " {line}");
    }
    text
}

/// `glibc (= <version>)` for the C library the static binary was linked with, or `None`
/// where dpkg does not know it (a toolchain outside Debian's packages).
fn built_using() -> Option<String> {
    output(Command::new("dpkg-query").args([
        "--show",
        "--showformat",
        "${source:Package} (= ${source:Version})",
        "libc6-dev",
    ]))
    .ok()
    .filter(|field| field.starts_with("glibc (= "))
}

/// `Installed-Size` the way dpkg-gencontrol counts it: KiB, each file rounded up, plus one
/// for each directory.
fn installed_size(tree: &Path) -> Result<u64> {
    let mut kib = 0;
    for file in &CONTENTS {
        kib += fs::metadata(tree.join(file.path))?.len().div_ceil(1024);
    }
    let dirs = directories_under(tree)?;
    Ok(kib + dirs.iter().filter(|dir| !dir.ends_with("DEBIAN")).count() as u64)
}

/// Every directory below `dir`, `dir` itself included.
fn directories_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found = vec![dir.to_path_buf()];
    let mut at = 0;
    while let Some(current) = found.get(at).cloned() {
        at += 1;
        for entry in
            fs::read_dir(&current).with_context(|| format!("list {}", current.display()))?
        {
            let entry = entry?;
            if entry.file_type()?.is_dir() {
                found.push(entry.path());
            }
        }
    }
    Ok(found)
}

fn write(to: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    if let Some(dir) = to.parent() {
        fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    fs::write(to, bytes).with_context(|| format!("write {}", to.display()))?;
    fs::set_permissions(to, fs::Permissions::from_mode(mode))?;
    Ok(())
}

/// `gzip -9n`: what Debian's policy asks of changelogs and man pages, and reproducible (no
/// name, no timestamp in the header).
fn gzip(bytes: &[u8]) -> Result<Vec<u8>> {
    use std::io::Write as _;
    let mut child = Command::new("gzip")
        .args(["-9n", "--stdout"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("run gzip")?;
    child.stdin.take().context("gzip stdin")?.write_all(bytes)?;
    let done = child.wait_with_output()?;
    ensure!(done.status.success(), "gzip failed ({})", done.status);
    Ok(done.stdout)
}

/// `SOURCE_DATE_EPOCH` if set, else the commit time of `HEAD`.
fn source_date_epoch(root: &Path) -> Result<u64> {
    if let Some(epoch) = std::env::var_os("SOURCE_DATE_EPOCH") {
        let epoch = epoch.to_string_lossy();
        return epoch
            .trim()
            .parse()
            .with_context(|| format!("SOURCE_DATE_EPOCH={epoch:?} is not a number"));
    }
    let time =
        output(
            Command::new("git")
                .current_dir(root)
                .args(["log", "-1", "--format=%ct", "HEAD"]),
        )
        .context("no SOURCE_DATE_EPOCH, and git cannot tell the time of HEAD")?;
    Ok(time.trim().parse()?)
}

pub(crate) fn changelog(version: &str, epoch: u64) -> String {
    format!(
        "{PACKAGE} ({version}) unstable; urgency=medium\n\n  \
         * bigfleet-agent {version}, packaged by `cargo xtask dist` from the BigFleet\n    \
         providers workspace.\n\n -- {MAINTAINER}  {}\n",
        rfc2822(epoch)
    )
}

/// The date format of Debian changelogs, always in UTC: `Thu, 01 Jan 1970 00:00:00 +0000`.
pub(crate) fn rfc2822(epoch: u64) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let days = epoch / 86_400;
    let seconds = epoch % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm), for days >= 0.
    let shifted = days + 719_468;
    let era = shifted / 146_097;
    let day_of_era = shifted % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153; // 0 = March
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 2
    } else {
        month_index - 10
    };
    let year = year_of_era + era * 400 + u64::from(month < 2);
    format!(
        "{}, {day:02} {} {year} {:02}:{:02}:{:02} +0000",
        DAYS[(days % 7) as usize],
        MONTHS[month as usize],
        seconds / 3600,
        seconds / 60 % 60,
        seconds % 60
    )
}

/// A man page in roff, made from clap's `--help` (the summary line, then `Options:` with each
/// flag on a line of its own and its text indented below), so it can never disagree with the
/// binary.
pub(crate) fn manual(help: &str, version: &str) -> Result<String> {
    let mut lines = help.lines();
    let summary = lines.next().unwrap_or_default().trim();
    ensure!(!summary.is_empty(), "--help starts with no summary line");
    let mut page = format!(
        ".TH BIGFLEET-AGENT 1 \"\" \"bigfleet-agent {version}\" \"System Administration\"\n\
         .SH NAME\nbigfleet-agent \\- {}\n\
         .SH SYNOPSIS\n.B bigfleet-agent\n[\\fIOPTIONS\\fR]\n\
         .SH DESCRIPTION\n{}\n.PP\n\
         The packaged systemd unit, bigfleet-agent.service, runs it once the provider's \
         user_data has written /etc/bigfleet-agent/config.json; its logs are in \
         \\fBjournalctl \\-u bigfleet-agent\\fR.\n\
         .SH OPTIONS\n",
        roff_text(summary),
        roff_text(summary),
    );
    let options = lines
        .by_ref()
        .find(|line| line.trim() == "Options:")
        .is_some();
    ensure!(options, "--help has no Options: section");
    let mut flags = 0;
    for line in lines {
        let text = line.trim();
        if text.is_empty() {
            continue;
        }
        if text.starts_with('-') && line.len() - line.trim_start().len() <= 6 {
            flags += 1;
            let _ = write!(
                page,
                ".TP\n\\fB{}\\fR\n",
                roff_text(text).replace('-', "\\-")
            );
        } else {
            let _ = writeln!(page, "{}", roff_text(text));
        }
    }
    ensure!(flags > 0, "--help lists no flags");
    page.push_str(
        ".SH FILES\n.TP\n/etc/bigfleet-agent/config.json\n\
         endpoint, pinned certificate, machine id and token, written by the provider\n\
         .TP\n/var/lib/bigfleet-agent/state.json\n\
         the commands run and their outcomes (mode 0600)\n\
         .SH SEE ALSO\n\\fBsystemctl\\fR(1), \\fBjournalctl\\fR(1)\n",
    );
    Ok(page)
}

/// Text that roff prints as it is: backslashes escaped, no line read as a request.
fn roff_text(text: &str) -> String {
    let text = text.replace('\\', "\\e");
    if text.starts_with(['.', '\'']) {
        format!("\\&{text}")
    } else {
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_and_names() {
        assert_eq!(debian_version("0.1.0"), "0.1.0");
        assert_eq!(debian_version("0.2.0-rc.1"), "0.2.0~rc.1");
        assert_eq!(file_name("0.1.0"), "bigfleet-agent_0.1.0_amd64.deb");
    }

    #[test]
    fn changelog_dates() {
        assert_eq!(rfc2822(0), "Thu, 01 Jan 1970 00:00:00 +0000");
        assert_eq!(rfc2822(951_782_400), "Tue, 29 Feb 2000 00:00:00 +0000");
        assert_eq!(rfc2822(1_796_050_140), "Mon, 30 Nov 2026 14:49:00 +0000");
        let log = changelog("0.1.0", 0);
        assert!(log.starts_with("bigfleet-agent (0.1.0) unstable; urgency=medium\n\n  * "));
        assert!(log.ends_with(&format!("\n\n -- {MAINTAINER}  {}\n", rfc2822(0))));
    }

    #[test]
    fn control_fields() {
        let text = control("0.1.0", 11_000, Some("glibc (= 2.36-9)"));
        assert!(text.starts_with("Package: bigfleet-agent\nVersion: 0.1.0\nArchitecture: amd64\n"));
        assert!(text.contains("\nInstalled-Size: 11000\nBuilt-Using: glibc (= 2.36-9)\n"));
        assert!(text.contains(&format!("\nDescription: {SUMMARY}\n The agent runs")));
        assert!(text.ends_with(" /etc/bigfleet-agent/config.json; logs go to the journal.\n"));
        assert!(!control("0.1.0", 1, None).contains("Built-Using"));
    }

    #[test]
    fn man_page_from_help() {
        let help = "An agent\n\nUsage: bigfleet-agent [OPTIONS]\n\nOptions:\n      \
                    --config <CONFIG>\n          The config \\ [default: /etc/x]\n  \
                    -h, --help\n          .Print help\n";
        let page = manual(help, "0.1.0").unwrap();
        assert!(page.contains(".SH NAME\nbigfleet-agent \\- An agent\n"));
        assert!(
            page.contains(".TP\n\\fB\\-\\-config <CONFIG>\\fR\nThe config \\e [default: /etc/x]\n")
        );
        assert!(page.contains(".TP\n\\fB\\-h, \\-\\-help\\fR\n\\&.Print help\n"));
        assert!(manual("An agent\n\nUsage: x\n", "0.1.0").is_err());
    }
}
