#!/bin/sh
# Prints the mesh Secret of the StatefulSet as YAML: the CA bundle, one leaf per pod and
# the fleet's adoption key (which seals upstream session ids in Redis), from a `mcpgw
# certs` directory on the operator's machine. Never the CA keys or the
# rotation state: this script names each file it takes, it never takes the directory.
#
#   deploy/kubernetes/mesh-secret.sh DIR REPLICAS [STATEFULSET] | kubectl apply -n NS -f -
#
# DIR holds ca.crt and STATEFULSET-0.crt/.key ... STATEFULSET-(REPLICAS-1).crt/.key,
# made by `mcpgw certs init --dir DIR` and `mcpgw certs issue --dir DIR --name
# mcpgw-0` (and so on). Run it again after every `mcpgw certs issue` and every stage of
# `mcpgw certs rotate` (docs/kubernetes.md): the kubelet swaps the files in each pod's
# volume at once and the workers reload them without a restart.
set -eu
if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: mesh-secret.sh DIR REPLICAS [STATEFULSET (default mcpgw)]" >&2
  exit 2
fi
DIR=$1
REPLICAS=$2
SET=${3:-mcpgw}
case $REPLICAS in
  '' | *[!0-9]*) echo "mesh-secret: REPLICAS must be a number, not '$REPLICAS'" >&2; exit 2 ;;
esac
if [ ! -f "$DIR/ca.crt" ]; then
  echo "mesh-secret: $DIR/ca.crt is missing: run \`mcpgw certs init --dir $DIR\` first" >&2
  exit 1
fi
if [ ! -f "$DIR/adoption.key" ]; then
  echo "mesh-secret: $DIR/adoption.key is missing: make it once with \`od -An -tx1 -N32 /dev/urandom | tr -d ' \\n' > $DIR/adoption.key\` (docs/kubernetes.md)" >&2
  exit 1
fi
set -- --from-file=ca.crt="$DIR/ca.crt" --from-file=adoption.key="$DIR/adoption.key"
i=0
while [ "$i" -lt "$REPLICAS" ]; do
  name=$SET-$i
  for part in crt key; do
    if [ ! -f "$DIR/$name.$part" ]; then
      echo "mesh-secret: $DIR/$name.$part is missing: run \`mcpgw certs issue --dir $DIR --name $name\`" >&2
      exit 1
    fi
    set -- "$@" --from-file="$name.$part=$DIR/$name.$part"
  done
  i=$((i + 1))
done
exec kubectl create secret generic "$SET-mesh" --dry-run=client -o yaml "$@"
