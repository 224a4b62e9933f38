# shellcheck shell=bash
# Sourced by gpu-mutants.sh: mutant NAME FILE SED TEST.
mutant() {  # NAME FILE SED TEST: run TEST with SED applied to FILE; a pass means the test misses the feature
  local name=$1 file=$2 edit=$3 test=$4
  cp "$file" /tmp/mutant.bak && sed -i "$edit" "$file"
  if cmp -s "$file" /tmp/mutant.bak; then echo "$name: the edit changed nothing"; else
    timeout 120 python3 -m pytest -q -m gpu -o addopts='' -p no:cacheprovider -x "$test" 2>&1 | tail -n 3
    echo "$name: pytest rc=${PIPESTATUS[0]} (non-zero: the test caught it)"
  fi
  cp /tmp/mutant.bak "$file"
}
