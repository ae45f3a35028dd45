#!/bin/sh
# The compose fleet's mesh certificates and adoption key, run as a one-shot container.
#
# Two directories on two volumes: CA_DIR holds the CA key and is mounted only here;
# CERTS_DIR is what the gateways mount (read-only): the CA bundle, each gateway's own
# leaf, and the fleet's adoption key file. Every `mcpgw certs` step works in CA_DIR,
# then the public files are published to CERTS_DIR by rename, so a worker never reads
# half a file and the CA key never reaches a gateway.
#
# The adoption key (ADOPTION_KEYS, `MCPGW_ADOPTION_KEY_FILE` of every gateway) seals
# the upstream session ids that the directory's adoption records hold, so that a
# reader of Redis cannot use them at the upstream; every gateway needs the same key to
# adopt another's sessions. It is made once, straight in CERTS_DIR: it is no CA
# material, and a rotation of the mesh certificates leaves it alone.
#
#   mesh-certs init                      CA and one leaf per name, and the adoption
#                                        key, once (safe to rerun)
#   mesh-certs rotate begin|reissue|finish|status
#                                        a stage of `mcpgw certs rotate`, then publish
#
# MCPGW_CERT_NAMES: the mesh members (one leaf each), separated by spaces or commas.
set -eu
CA_DIR=${MCPGW_CA_DIR:-/var/lib/mcpgw/ca}
CERTS_DIR=${MCPGW_CERTS_DIR:-/var/lib/mcpgw/certs}
NAMES=$(echo "${MCPGW_CERT_NAMES:?set MCPGW_CERT_NAMES to the mesh members, e.g. gw1 gw2 gw3}" | tr ',' ' ')
ADOPTION_KEYS="$CERTS_DIR/adoption.keys"

is_member_name() {
  for name in $NAMES; do [ "$name" = "$1" ] && return 0; done
  return 1
}

# Publishes every certificate and bundle file of CA_DIR, and the leaf keys of the
# members; never a CA key (any other *.key). Unchanged files are left alone.
publish() {
  for file in "$CA_DIR"/*; do
    [ -f "$file" ] || continue
    base=$(basename "$file")
    case $base in
      *.key) is_member_name "${base%.key}" || continue ;;
    esac
    if ! cmp -s "$file" "$CERTS_DIR/$base"; then
      cp -p "$file" "$CERTS_DIR/.$base.tmp"
      mv -f "$CERTS_DIR/.$base.tmp" "$CERTS_DIR/$base"
      echo "mesh-certs: published $base"
    fi
  done
}

# Writes ADOPTION_KEYS (one key of 64 hex digits, readable by the gateways' user
# only) unless it holds one already: a new key on a rerun would leave the records
# sealed with the old one unreadable.
make_adoption_key() {
  if [ -s "$ADOPTION_KEYS" ]; then return 0; fi
  key=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
  if [ ${#key} -ne 64 ]; then
    echo "mesh-certs: could not read 32 random bytes for the adoption key" >&2
    exit 1
  fi
  (
    umask 077
    printf '# mcpgw adoption keys: one per line, the first seals (MCPGW_ADOPTION_KEY_FILE)\n%s\n' \
      "$key" >"$CERTS_DIR/.adoption.keys.tmp"
  )
  mv -f "$CERTS_DIR/.adoption.keys.tmp" "$ADOPTION_KEYS"
  echo "mesh-certs: made $(basename "$ADOPTION_KEYS")"
}

case ${1:-init} in
  init)
    if [ ! -f "$CA_DIR/ca.crt" ]; then mcpgw certs init --dir "$CA_DIR"; fi
    for name in $NAMES; do
      if [ ! -f "$CA_DIR/$name.crt" ]; then mcpgw certs issue --dir "$CA_DIR" --name "$name"; fi
    done
    publish
    make_adoption_key
    ;;
  rotate)
    shift
    mcpgw certs rotate "$@" --dir "$CA_DIR"
    publish
    ;;
  publish) publish ;;
  *)
    echo "usage: mesh-certs [init | rotate STAGE | publish]" >&2
    exit 2
    ;;
esac
