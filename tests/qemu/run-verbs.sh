#!/usr/bin/env bash
# The `qemu` suite's verbs test: hcomm's verbs transport on Soft-RoCE (rxe) in
# QEMU guests (tests/qemu/run-rdma.sh boots them; command lists in
# tests/qemu/verbs/):
#   loopback  one guest, HCOMM_TRANSPORTS=verbs forced between ranks of one
#             host: the API conformance suite at 2 and 4 ranks, every op,
#             dtype and size up to 64 MiB (rendezvous by READ below 128 KiB, by
#             WRITE from there; the two-sided cases again with HCOMM_RNDV=get and
#             =put: every size by READ, by WRITE), asserting verbs serves every peer
#             and that rxe's counters moved; the 2-rank runs (and the one by WRITE)
#             with HCOMM_IB_MAX_MSG=65536, so their messages are split into
#             pieces, more than a send queue holds (the 4-rank run splits at
#             rxe's 8 MiB); and, as an unprivileged user with
#             a 64 KiB RLIMIT_MEMLOCK, init failing with a message naming it;
#             and hcomm-probe seeing the QEMU TCG guest (whose busy polls run
#             without the pause hint, common/barrier.h);
#   pair      two guests = two hosts, ranks on both (torchrun-style
#             MASTER_ADDR = the first guest): the conformance suite at 2 and 4
#             ranks (sizes up to 1 MiB: TCG moves a few MB/s between guests),
#             the four examples (parameter_server on 256 KiB of weights), and a
#             silent peer (netem loss 100% on one guest) noticed as peer
#             failure within the keepalive bound (+ 5 s of slack), and
#             again while a put is in flight, with HCOMM_IB_TIMEOUT=13,
#             HCOMM_IB_RETRY=3 and a 60 s keepalive: the queue pair's retries
#             end it within 4.096 us x 2^13 x 4 = 134 ms (+ 300 ms); the same
#             with put_nbi + flush, and with a 256 KiB put split into 64-byte
#             pieces that fails waiting for send-queue room (cut short);
#   (loopback and pair also check that rxe neither sent nor received an RNR
#   NAK: the credits keep every SEND inside a posted receive buffer)
#   netem     the same pair with 5% loss + reordering on one guest, sizes up to
#             64 KiB: send/recv (rendezvous by READ, then by WRITE with
#             HCOMM_RNDV=put), truncation, put/get, implicit operations and
#             flush, put_notify, fence, accumulate, fetch atomics and the key
#             checks: results exact, netem dropped packets and rxe retransmitted.
#   asan      for an ASan+UBSan build (the `qemu_asan` suite, run by CI's
#             sanitizer stage): the cancel rule's cases (timed-out blocking
#             calls, request cancel, cancelled one-sided operations) and the
#             key checks over verbs, in one guest (2 and 4 ranks, rendezvous
#             by READ and by WRITE) and across the two guests, after checking
#             that the binary in the guest does run under ASan. Late writes
#             by the NIC are invisible to ASan: the cases check canaries.
#   tests/qemu/run-verbs.sh BUILD_DIR [loopback|pair|netem|asan]...   (default: the first three)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "$1" && pwd)
shift
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(loopback pair netem)
export HCOMM_RDMA_FILES="$build/tests/integration_api_conformance $build/tests/integration_transports $build/tools/hcomm-probe $build/examples/point_to_point $build/examples/put_get $build/examples/parameter_server $build/examples/pipeline"
# The guest image once for every mode (run-rdma.sh would rebuild it per run):
# the cache and the image directory are exported, so run-rdma.sh boots what
# was built here.
export HCOMM_QEMU_CACHE=${HCOMM_QEMU_CACHE:-$build/qemu-guest/cache}
export HCOMM_RDMA_GUEST=${HCOMM_RDMA_GUEST:-$build/qemu-rdma-guest}
bash "$here/build-guest.sh" "$build" "$HCOMM_RDMA_GUEST" rdma
export HCOMM_RDMA_BUILT=1
rc=0
for m in "${modes[@]}"; do
  start=$(date +%s)
  case $m in
    loopback) HCOMM_RDMA_MEM=2048M HCOMM_RDMA_TIMEOUT=${HCOMM_VERBS_TIMEOUT:-420} \
                HCOMM_RDMA_CMDS="$here/verbs/loopback.cmds" bash "$here/run-rdma.sh" "$build" loopback || rc=1 ;;
    pair)     HCOMM_RDMA_MEM=1536M HCOMM_RDMA_TIMEOUT=${HCOMM_VERBS_TIMEOUT:-420} \
                HCOMM_RDMA_CMDS="$here/verbs/pair.cmds" bash "$here/run-rdma.sh" "$build" pair || rc=1 ;;
    netem)    HCOMM_RDMA_MEM=1024M HCOMM_RDMA_TIMEOUT=${HCOMM_VERBS_TIMEOUT:-360} \
                HCOMM_RDMA_CMDS="$here/verbs/netem.cmds" bash "$here/run-rdma.sh" "$build" pair netem || rc=1 ;;
    asan)     HCOMM_RDMA_FILES="$build/tests/integration_api_conformance" HCOMM_RDMA_MEM=2048M \
                HCOMM_RDMA_TIMEOUT=${HCOMM_VERBS_TIMEOUT:-300} HCOMM_RDMA_CMDS="$here/verbs/asan.cmds" \
                bash "$here/run-rdma.sh" "$build" loopback || rc=1
              HCOMM_RDMA_FILES="$build/tests/integration_api_conformance" HCOMM_RDMA_MEM=1536M \
                HCOMM_RDMA_TIMEOUT=${HCOMM_VERBS_TIMEOUT:-300} HCOMM_RDMA_CMDS="$here/verbs/asan-pair.cmds" \
                bash "$here/run-rdma.sh" "$build" pair || rc=1 ;;
    *) echo "run-verbs: unknown mode $m" >&2; exit 2 ;;
  esac
  echo "---- run-verbs $m: $(( $(date +%s) - start ))s ----"
done
exit $rc
