cd /tmp/s32; mkdir -p pairs
for rnd in 1 2 3 4; do
  if [ $((rnd % 2)) = 0 ]; then cfg=colocated-cache,global-cache; else cfg=global-cache,colocated-cache; fi
  PMK_PACE_S=0.08 PYTHONPATH=/tmp/s32/P/src /work/main/.venv/bin/python -m pymooncake bench serving --configs $cfg --json > pairs/run_$rnd.json 2>/dev/null
  python3 /work/main/docs/data/issue16_s28/sumserv.py pairs 2>/dev/null | grep "run_$rnd"
done
