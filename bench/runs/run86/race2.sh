tar -C .device -xJf .device/bundle.tar.xz && mv .device/bin/* .device/
export MIXSTACK_TEST_SMALL=race MIXSTACK_VECTORS=$PWD/vectors
nvidia-smi --query-gpu=name --format=csv,noheader
for t in fused_bitwise_equals_relay_every_tile switch_drives_dispatch memory_accounting profiling_records_each_launch raw_api_matches_slice_api scratch_cap_environment_is_read_and_checked reference_vectors gate_gemms_on_cublas_from_cf96 random_shapes_match_reference relay_tiles_bitwise_equal_every_tile fused_persistent_walk_bitwise; do
  s=$(date +%s)
  timeout 170 compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 400 .device/gpu_stack --test-threads=1 --exact $t > $OUT/r_$t.log 2>&1
  rc=$?
  echo "$t rc=$rc $(( $(date +%s)-s )) s: $(grep -E 'RACECHECK SUMMARY' $OUT/r_$t.log) $(grep -oE 'at ms_[a-z0-9_]+' $OUT/r_$t.log | sort | uniq -c | tr '\n' ' ')"
  grep -q "test result: ok" $OUT/r_$t.log || grep -E "panicked|FAILED" $OUT/r_$t.log | head -3
done
