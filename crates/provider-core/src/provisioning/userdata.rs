//! Cloud-init user-data assembly shared by both providers: the provider's own cloud-config
//! alone, or merged after the operator's `--base-user-data` as a MIME multipart archive.

use rand::Rng;

/// The MIME type cloud-init should use for the operator's part, sniffed from its first line.
pub fn sniff_content_type(user_data: &str) -> &'static str {
    let start = user_data.trim_start();
    if start.starts_with("#cloud-config") {
        "text/cloud-config"
    } else if start.starts_with("#cloud-boothook") {
        "text/cloud-boothook"
    } else if start.starts_with("#!") {
        "text/x-shellscript"
    } else {
        "text/cloud-config"
    }
}

/// Builds the user-data: `ours` (a `#cloud-config` document) alone when the operator gave no
/// base user-data, else a two-part `multipart/mixed` archive, the operator's part first and
/// verbatim. The boundary is 60 random hex characters.
pub fn assemble(base: Option<&str>, ours: &str) -> String {
    let base = base.filter(|b| !b.trim().is_empty());
    let Some(base) = base else {
        return ours.to_owned();
    };
    let mut bytes = [0u8; 30];
    rand::rng().fill_bytes(&mut bytes);
    let boundary: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    assemble_with_boundary(base, ours, &boundary)
}

fn assemble_with_boundary(base: &str, ours: &str, boundary: &str) -> String {
    let mut out = String::with_capacity(base.len() + ours.len() + 400);
    out.push_str(&format!(
        "Content-Type: multipart/mixed; boundary=\"{boundary}\"\n"
    ));
    out.push_str("MIME-Version: 1.0\n\n");
    for (i, (content_type, body)) in [
        (sniff_content_type(base), base),
        ("text/cloud-config", ours),
    ]
    .into_iter()
    .enumerate()
    {
        if i > 0 {
            out.push_str("\r\n");
        }
        out.push_str(&format!("--{boundary}\r\n"));
        out.push_str(&format!("Content-Type: {content_type}\r\n"));
        out.push_str("Mime-Version: 1.0\r\n\r\n");
        out.push_str(body);
    }
    out.push_str(&format!("\r\n--{boundary}--\r\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniffs_the_operator_part() {
        assert_eq!(
            sniff_content_type("  #cloud-config\na: 1"),
            "text/cloud-config"
        );
        assert_eq!(sniff_content_type("#!/bin/sh\necho"), "text/x-shellscript");
        assert_eq!(
            sniff_content_type("#cloud-boothook\n"),
            "text/cloud-boothook"
        );
        assert_eq!(sniff_content_type("packages: [jq]"), "text/cloud-config");
    }

    #[test]
    fn bare_when_no_base() {
        assert_eq!(
            assemble(None, "#cloud-config\nx: 1\n"),
            "#cloud-config\nx: 1\n"
        );
        assert_eq!(assemble(Some("  \n"), "#cloud-config\n"), "#cloud-config\n");
    }

    #[test]
    fn multipart_framing() {
        let doc = assemble_with_boundary("#!/bin/sh\necho hi\n", "#cloud-config\nk: v\n", "b0");
        assert_eq!(
            doc,
            "Content-Type: multipart/mixed; boundary=\"b0\"\nMIME-Version: 1.0\n\n\
             --b0\r\nContent-Type: text/x-shellscript\r\nMime-Version: 1.0\r\n\r\n#!/bin/sh\necho hi\n\
             \r\n--b0\r\nContent-Type: text/cloud-config\r\nMime-Version: 1.0\r\n\r\n#cloud-config\nk: v\n\
             \r\n--b0--\r\n"
        );
        let random = assemble(Some("#cloud-config\n"), "#cloud-config\n");
        let boundary = random.split('"').nth(1).unwrap();
        assert_eq!(boundary.len(), 60);
        assert!(boundary.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
