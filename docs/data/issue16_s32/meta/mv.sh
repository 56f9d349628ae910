for rnd in 1 2 3 4 5; do
 for v in "A -" "B -" "A 0" "B 0"; do set -- $v
  r=$(PYTHONPATH=/tmp/s32/$1/src /work/main/.venv/bin/python mv.py $2 2>/dev/null)
  echo "$rnd $1 mpoll=$2 $r"
 done
done
