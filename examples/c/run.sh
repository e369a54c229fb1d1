#!/bin/sh
# Runs prefill_decode (prefill_decode.c) as two processes: decode prints its endpoint and
# KV address, prefill transfers and prints the transfer id, decode syncs it.
set -eu
exe=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
mkfifo "$dir/to_decode" "$dir/from_decode"
"$exe" decode <"$dir/to_decode" >"$dir/from_decode" &
decode=$!
exec 3>"$dir/to_decode" 4<"$dir/from_decode"
read -r endpoint address <&4
id=$("$exe" prefill "$endpoint" "$address")
echo "prefill: transfer $id to $endpoint"
echo "$id" >&3
exec 3>&-
cat <&4
wait "$decode"
