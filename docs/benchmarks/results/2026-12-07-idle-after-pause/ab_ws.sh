#!/bin/bash
# needs measurement.patch applied (SPLITSERVE_IDLE_OLD=1 restores the code before d8c350d)
# ab_ws.sh ROOT "a b b a": W-single-like runs (wsingle.sh: 64 in / 128 out, one at a time, 30 prompts with N=30); a: SPLITSERVE_IDLE_OLD=1 (before), b: d8c350d
ROOT=$1; ORDER=$2; i=0
for side in $ORDER; do
  i=$((i+1)); O=$ROOT/run$i-$side; mkdir -p $O
  if [ $side = a ]; then E="SPLITSERVE_IDLE_OLD=1"; else E="SPLITSERVE_IDLE_NEW=1"; fi
  ( export $E; OUT=$O $(dirname "$0")/wsingle.sh > $O/out.txt 2>&1 )
  echo "$side $(grep overall $O/load.log)"
done
