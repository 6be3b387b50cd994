#!/usr/bin/env bash
# As run: the loop of ../2026-12-06-qwen-tile-setup/run.sh from the checkout at commit
# 8a73676 (c5dc717: decode attention prefetching into L2; its code unchanged since), the
# results into this folder.
here=$(cd "$(dirname "$0")" && pwd)
TREE=/work/main R=$here exec "$here/../2026-12-06-qwen-tile-setup/run.sh"
