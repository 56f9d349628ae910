for rnd in 1 2 3 4; do
 for v in A C D; do
  r=$(PYTHONPATH=/tmp/s32/$v/src /work/main/.venv/bin/python mv.py - 2>/dev/null)
  echo "$rnd $v $r"
 done
done
