#!/usr/bin/env bash
# The accepted f32 instances of one stage at one Cf in one precision mode
# (PRECISION, default exact: the fused tile scripts compare the exact
# mode's tiles), a name a line, each once
# (the report has a row per arch), in the report's order, those whose names
# MATCH (a regex) keeps. Over the staged binary (.device/mixstack).
#   scripts/instances.sh STAGE CF
set -uo pipefail
.device/mixstack report --json | python3 -c "
import json, os, sys
stage, cf = sys.argv[1], int(sys.argv[2])
rows = json.load(sys.stdin)['instances']
keep = (i['name'] for i in rows if i['stage'] == stage and i['dtype'] == 'f32' and i['cf'] == cf and i['accepted']
        and i.get('precision', 'exact') == os.environ.get('PRECISION', 'exact'))
print('\n'.join(dict.fromkeys(keep)))" "$1" "$2" | grep -E "${MATCH:-.}"
