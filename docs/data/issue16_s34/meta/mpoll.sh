cd /work/main
for r in 1 2 3; do
for v in default 0 default2; do
  if [ $v = 0 ]; then F="--rpc-poll 0"; else F=""; fi
  .venv/bin/pymooncake bench store --metadata-only --no-mooncake --metadata-ops 20000 --metadata-clients 1 --metadata-clients 2 --metadata-clients 4 $F 2>/dev/null | sed "s/^/$r $v /"
done; done
