#!/usr/bin/env bash
# Install the named Debian packages that are missing (idempotent: installed ones are skipped).
# Not root and no passwordless sudo: say which are missing and go on; the tests that need them skip
# with a message saying why.
set -euo pipefail
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO=(sudo -n); else
    echo "apt_install: not root; missing Debian packages: ${missing[*]} (tests needing them will skip)" >&2
    exit 0
  fi
else SUDO=(); fi
echo "apt_install: installing ${missing[*]}" >&2
# Keep postinst scripts from starting daemons (munge, mariadb, slurm): tools/slurm_local starts its own.
added_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee /usr/sbin/policy-rc.d >/dev/null
  "${SUDO[@]}" chmod 755 /usr/sbin/policy-rc.d
  added_policy=1
fi
trap '[ $added_policy -eq 1 ] && "${SUDO[@]}" rm -f /usr/sbin/policy-rc.d' EXIT
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
