#!/usr/bin/env bash
# device run 4: the merged HEAD: gpu_check (the paged thinker, the audio cache), seedtts-like c=1,64
set -u
O=$OUT
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
timeout 150 bash bench/device.sh python3 -m voxpipe.bench.gpu_check > $O/gpu_check.txt 2>&1; echo "rc=$?" >> $O/gpu_check.txt
grep -E '"exact": false|rc=|Error' $O/gpu_check.txt | tail -8
grep -c '"check"' $O/gpu_check.txt
(VOXPIPE_COMMIT=$1 timeout 220 bash bench/device.sh voxpipe --log-level WARNING bench --mps --quick --workload seedtts-like \
   --concurrency 1,64 --modes gateway --no-reference --out /tmp/seed > $O/seed.log 2>&1; echo "rc=$?" >> $O/seed.log)
cp /tmp/seed/results.md $O/seed-results.md 2>/dev/null
grep -E "^\| gateway|rc=|Error" $O/seed.log | tail -16
