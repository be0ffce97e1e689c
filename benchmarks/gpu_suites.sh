#!/usr/bin/env bash
# GPU benchmark suites of flowrl (benchmarks/README.md says how to run them; docs/performance.md
# holds the current results and the machine they were measured on).
#
#   bash benchmarks/gpu_suites.sh SUITE [SUITE ...]       (from the repo root)
#
# Suites (each fits one 10-minute device command on its own; estimates for one GPU of that machine):
#   tests     GPU tests (tests/bench: no host sync inside the engine step loop, compile;
#             tests/models, tests/accel: the fast paths and hand-written kernels;
#             tests/benchmarks: the cuBLASLt candidates)                                    ~2-3 min
#   tests-trainer  GPU tests of tests/trainer: bf16 training runs on CUDA, eager and compiled
#             (LoRA, gradient checkpointing, bf16 autocast, CFG), and their log-prob gaps, less those of
#             tests-trainer-update and tests-cuda-graphs (all of tests/trainer ran past 540 s) ~6-8 min
#   tests-trainer-update  the update's device waits per optimizer step (SD3, Qwen-Image), merged
#             rollouts compiling once (rollout.merge_lora) and their compiled rounding equal to the
#             CPU's, gradient_checkpointing=auto's probe                                      ~6.5 min
#   tests-cuda-graphs  the GPU test of trainer.cuda_graphs: a compiled tiny Qwen-Image's update with its
#             training graphs replayed as CUDA graphs accumulates the gradients it does without ~1-2 min
#   tests-checkpointing  the GPU test of trainer.gradient_checkpointing=auto: the probe on a compiled
#             tiny Qwen-Image on CUDA, and the run equal to checkpointing off                  ~1-2 min
#   sd35      SD3.5-medium rollout: 16 samples, 10 steps, no CFG, eager + compiled,
#             then the bf16 log-prob gap (micro-batches 1, 8, 32) and a LoRA training step ~5-7 min
#   qwen      Qwen-Image rollout: 16 samples, 50 steps, no CFG, eager + compiled          ~5-7 min
#   flux      FLUX.1 [dev] rollout: 16 samples, 28 steps, guidance 3.5 (the guidance embedding:
#             one row per sample), 512 px, eager + compiled                                  ~6-8 min
#   flux-vs-pipeline  the same, the diffusers pipeline at batch 16 and the compiled engine only, with a
#             profile of 2 steps (the measured row of docs/performance.md)                 ~5 min
#   flux-logprob  FLUX.1 [dev]'s bf16 log-prob gap and LoRA training step at the FLUX recipe's
#             settings (6 steps, noise 0.9, guidance 3.5, LoRA r64, bf16 autocast, compiled,
#             gradient checkpointing), micro-batches 1, 8                                   ~5-7 min
#   sd35-large  SD3.5-large rollout: 16 samples, 10 steps, CFG 4.5 (32 rows), eager + compiled ~6-8 min
#   sd35-large-vs-pipeline  the same, the diffusers pipeline at batch 16 and the compiled engine
#             modes only (the measured row of docs/performance.md)                       ~4 min
#   z-image-vs-pipeline  Z-Image's rollout (as z-image), the pipeline at batch 16 and the compiled
#             engine only (the measured row of docs/performance.md)                       ~3 min
#   sd35-large-logprob  SD3.5-large's bf16 log-prob gap and LoRA training step at its recipe's
#             settings (CFG 4.5, LoRA r32, bf16 autocast, compiled, gradient checkpointing,
#             recompute, KL 0.04)                                                            ~6-8 min
#   qwen-cfg  Qwen-Image rollout with true CFG 4.0 (batched modes), then the Qwen-Image
#             log-prob gap (micro-batches 1, 4, 8) and a LoRA training step                  ~5-7 min
#   qwen-compiled      the qwen rollout, compiled engine modes only, 3 repeats, a profile   ~5 min
#   qwen-cfg-compiled  the CFG rollout, compiled engine only                                 ~4 min
#   qwen-compiled-lora the qwen rollout, compiled engine, with a rank-32 LoRA adapter on the
#                      attention projections (as training rolls out), profiled: what LoRA's
#                      small GEMMs cost per step                                               ~5 min
#   qwen-logprob-compiled-full  the same gap with full fine-tuning (--lora-rank 0): the rollout's
#                      hand-written q/k and v kernels apply (plain projections); no optimizer;
#                      a profile of the training step                                           ~4 min
#   qwen-train-step    the compiled LoRA rank-32 gap and training step as the Qwen recipe trains
#                      (bf16 autocast, true CFG 4, gradient checkpointing, old_log_prob recompute:
#                      no value pass), micro-batch 2 (4 rows), profiled (GPU busy share, top kernels) ~4 min
#   qwen-train-step-eager  qwen-train-step without engine.compile (the eager step to compare) ~3 min
#   qwen-train-micro-batches  the compiled training step exactly as the Qwen recipe sets it (LoRA
#                      rank 64, bf16 autocast, true CFG 4, checkpointing, recompute) at micro-batches
#                      2, 4 (the recipe's) and 8, each profiled: what a sample costs and how busy
#                      the GPU is at each size (host-bound work: run it with GPUS=1)            ~5 min
#   sd35-train-step    the compiled LoRA rank-32 gap and training step as the SD3.5 recipe trains
#                      (bf16 autocast, CFG 4.5, gradient checkpointing, recompute, KL 0.04: the
#                      reference's forward), micro-batch 8 (16 rows), profiled                ~6-8 min
#   sd35-train-step-graphs / qwen-train-step-graphs  each recipe's compiled training step at its
#                      micro-batch, checkpointing off (as `auto` chooses), timed without and then with
#                      its training graphs replayed as CUDA graphs (--cuda-graphs both), one process;
#                      the SD3.5 one ran past its 560 s on an H200 (the rollout's compile 142 s) before
#                      the graphed step was timed: give it BENCH_BUDGET_S=600 and a command of its own  ~10 min
#   sd35-train-step-eager  the same without engine.compile                                    ~3 min
#   train-step  `flowrl bench train` (the whole training step, phase by phase, with the peer's loop)
#             on random weights, jpeg_compressibility reward, embedded prompts: the Qwen-Image
#             recipe at 2 prompts x 16 samples, compiled as the recipe runs (~6-7 min), then the
#             SD3.5-medium recipe at 1 prompt x 16 with engine.compile=false (~1.5 min: its
#             compiled first step alone takes about 7 minutes, which train-step-sd35 spends); more
#             than one 10-minute device command holds: run the two as separate commands      ~8-9 min
#   train-step-qwen / train-step-sd35  each recipe alone as the recipe runs (compiled), ~6.5 / ~9 min
#             (train-step-qwen without its peer: ~5 min; train-step-sd35's first step, which
#             compiles, took 419 s on an H200); STEPS=K times K steps, PEER_STEPS=0 skips the peer,
#             PROFILE=1 adds one profiled step (--profile), OVERRIDES="key=value ..." adds recipe
#             overrides (after the suite's own, e.g. OVERRIDES="trainer.micro_batch_size=6");
#             train-step-qwen-graphs / train-step-sd35-graphs: with trainer.cuda_graphs=true (the
#             SD3.5 update idles about a quarter of its time in short gaps; its first step compiles and
#             records the graphs too: train-step-sd35-graphs with PEER_STEPS=0 took 397 s cold on an H200);
#             train-step-qwen-workspace: with cuBLASLt's workspace at WORKSPACE_KIB (default 262144 KiB,
#             8 x PyTorch's Hopper default): do the update's memsets before split-K GEMMs go away?
#             train-step-qwen-merged: with rollout.merge_lora=true (training rollouts on merged LoRA
#             weights); `PEER_STEPS=0 STEPS=2 ... train-step-qwen train-step-qwen-merged` times both
#             in one command (the second compiles with the first's inductor cache warm)     ~8 min;
#             train-step-sd35-merged: train-step-sd35 with rollout.merge_lora=true
#   train-step-sd35-steps3  train-step-sd35 scoring 3 trained steps per forward (trainer.steps_per_forward:
#             48 rows per forward instead of 16, 3 x the activations), against train-step-sd35     ~9 min
#   train-step-qwen-ocr  train-step-qwen with the recipe's own OCR reward (rapidocr on the host's
#             CPUs; its wheels in .whl/, benchmarks/README.md) on `flowrl data ocr` prompts, zero-spread
#             groups kept (random weights draw noise, which reads as little or no text: groups of equal
#             rewards, which the recipe's drop would leave untrained and the update untimed); no peer;
#             then one more step profiled phase by phase (--profile: how busy the GPU was, the host ops
#             running while it idled). Noise is a light OCR load (few text boxes to recognize): its
#             reward phase is a lower bound of real images'                               ~5.5 min
#   tiny-qwen-gap-variants  the tiny Qwen-Image's compiled gap on CUDA with CFG, autocast and
#                      gradient checkpointing one at a time, all together, full fine-tuning
#                      under autocast, and eager                                              ~3 min
#   lora-gemm-gaps     benchmarks/lora_gemm_gaps.py: one Qwen-Image block's LoRA projections alone at the
#                      recipe's 64 rollout rows (folded, unfolded, base only, host-synced, after the block's
#                      masked attention, 60 blocks queued with the host free or bounded): time per block, GPU
#                      busy, the long gaps by the kernel that ended them and the one before   ~1 min
#   lora-gemm-gaps-sustained  the same projections, 700 blocks queued at once (18 s of GEMMs at the card's
#                      power cap), with nvidia-smi's SM clock, power and power-cap state every 250 ms ~1 min
#   checkpoint-ab      benchmarks/checkpoint_host_time.py: one Qwen-Image training fwd + bwd (LoRA 32,
#                      1 sample with CFG) with the gradient checkpoint inside each compiled block,
#                      around it, and none: time, activations kept, equal log-probs          ~3 min
#   qwen-gemm-shapes   benchmarks/qwen_gemm_shapes.py: each GEMM shape of a B=16 block on its own,
#                      with the MLP up-projection's GELU-epilogue variants                  ~1.5 min
#   qwen-floor         benchmarks/floor.py: one B=16 forward's matmuls and attention alone,
#                      against the eager and compiled forward                                ~3 min
#   qwen-floor-autotune  the same with inductor's GEMM autotuning (max-autotune) on          ~4 min
#   train-floors       benchmarks/floor.py --train at the Qwen-Image and SD3.5-M recipes' settings: each
#                      pass's matrix products alone against its FLOP limit, for the training call
#                      (micro-batch rows, the recipe's LoRA and text length) and the rollout forward
#                      (its rows); train-floors-qwen, train-floors-sd35: one recipe's         ~4 min
#   qwen-logprob-compiled  the Qwen-Image log-prob gap with rollout and trainer compiled   ~3 min
#   sd35-compiled      SD3.5-medium rollout: diffusers B=16 and the compiled engine, 3 repeats
#                      (its VAE decoder compile alone took 196-250 s)                       ~5-6 min
#   qwen-vae-decode    benchmarks/qwen_vae_decode.py: one B=16 512 px decode, stock 3D vs 2D   ~1 min
#   qwen-block-variants  benchmarks/qwen_block_variants.py: one compiled B=16 block per activation
#                      layout and compile rounding, timed, with its top kernels                ~3 min
#   qwen-forward-ab / qwen-forward-ab-fused   benchmarks/qwen_forward_ab.py: the compiled B=16
#                      forward with batch-major and sequence-major blocks, alternating, one GPU ~3 min
#   qwen-joint-kernel-ab  qwen_block_variants.py: the B=16 block as the rollout compiles it, without
#                      the joint v projection, and without it and the q/k kernel               ~2 min
#   qwen-table-kernel-ab  qwen_forward_ab.py --compare table-kernel: the compiled B=16 forward with
#                      and without the modulation table and the modulated-norm kernel, alternating ~4 min
#   qwen-lora-block    qwen_block_variants.py: the B=16 block as the rollout compiles it, without and
#                      with the trainer's rank-32 LoRA on the attention projections (the low-rank
#                      term inside the GEMMs' outputs, and left to inductor), with its kernels ~2 min
#   qwen-lora-block-recipe  qwen_block_variants.py: one block as the Qwen recipe's training rollout compiles it
#                      (64 rows, a padded text mask, rank-64 LoRA on the attention and MLP projections), folded
#                      (low-rank GEMM first, and base GEMM first),
#                      left to inductor, and without LoRA: time, kernels, and the long gaps with the kernel
#                      before them (does one compiled block show the rollout's waits after its base GEMMs?) ~3 min
#   qwen-lora-block-launch  the folded and unfolded LoRA blocks of qwen-lora-block-recipe launched directly, with
#                      a synchronize after each call, and replayed as a CUDA graph (is the wait after their base
#                      GEMMs in the kernels' order, or in how far the host runs ahead?); then both launched
#                      directly with cuBLASLt's workspace at WORKSPACE_KIB (default 262144); each
#                      variant's inductor code in $OUT/qwen-lora-block-launch-code              ~4 min
#   lora-joint-k  lora_joint_k.py: one Qwen-Image block's image-stream q, k, v and MLP projections at the
#                      recipe's 64 rollout rows with rank-64 LoRA: without LoRA, the shipped folded ops, and as
#                      GEMMs over a joint contraction [x | x A^T] (q, k, v sharing one buffer)            ~1 min
#   qwen-lora-gelu-ab  qwen_block_variants.py: the block of qwen-lora-block-recipe with the adapted MLP's GELU in
#                      the epilogue of one GEMM over [x | x A^T] (shipped), and as a pass of its own, twice each ~2 min
#   qwen-train-block   qwen_train_block.py: one block's training forward + backward at the recipe's micro-batch (8
#                      rows, masked) against its no-grad forward, with the recipe's LoRA (attention + MLPs),
#                      attention-only LoRA and none: the update's time per FLOP, and its kernels  ~3 min
#   qwen-train-block-memsets  the same block unmasked (as flowrl bench train's equal-length prompts),
#                      with the recipe's LoRA and SDPA's own choice, without LoRA, and with LoRA on
#                      cuDNN's and on flash attention: which op's device memsets end the update's
#                      long GPU gaps (the LoRA factors' split-K weight gradients, or cuDNN's
#                      attention), and what each costs a training call                          ~5.5 min
#   attention-backends  attention_backends.py: SDPA's cuDNN, flash and memory-efficient backends against
#                      its own choice at the Qwen-Image and SD3.5-medium recipes' attention shapes,
#                      forward and forward + backward                                          ~1 min
#   gemm-memsets       gemm_memsets.py: that block's GEMM shapes alone (both streams, forward and input
#                      gradient) under PyTorch's defaults, with bf16 reduced-precision reductions
#                      off and on cuBLASLt: which issue a device memset, and at what cost         ~0.5 min
#   cublaslt-memsets   cublaslt_algos.py at the training block's 8 rows, the image stream's GEMMs: does
#                      a cuBLASLt candidate without the memset run as fast as PyTorch's choice  ~2 min
#   qwen-train-block-combo  the same block with the recipe's LoRA, without and with inductor's combo
#                      kernels (independent small kernels, such as the LoRA weights' casts, launched
#                      as one), in the training graph and the rollout's                          ~3 min
#   lora-merge-time    lora_merge_time.py: one merge of rollout.merge_lora on Qwen-Image with the recipe's
#                      LoRA (rank 64, every adapted projection), rounding eager and compiled, against the
#                      s B A products alone and the merge's least memory traffic                  ~1.5 min
#   qwen-train-block-autotune  the same block with the recipe's LoRA, with and without inductor's GEMM
#                      autotuning (max_autotune_gemm: Triton templates, epilogues fused, timed against
#                      cuBLAS for each of the graphs' matrix products)                          ~6-9 min
#   qwen-train-block-tuning  the same block with the recipe's LoRA compiled with and without
#                      coordinate-descent tuning of its kernels (inductor's caches off): each graph's
#                      compile time against its training call's time                          ~4 min
#   qwen-text-mask-attention  qwen_text_mask_attention.py: the joint attention of a padded batch (the rollout's 64
#                      rows forward, the trainer's 8 rows forward + backward), masked, per run of equal text
#                      lengths, and unmasked                                                      ~1 min
#   qwen-prefix-attention-ab  qwen_block_variants.py and qwen_train_block.py: the recipe's LoRA block with padded
#                      text, its attention per run of equal lengths (shipped) and masked: the rollout's block
#                      twice each, alternating, then the training call                            ~5 min
#   qwen-lora-order    qwen_block_variants.py: the LoRA block with the base GEMM written first (the
#                      low-rank one accumulating into it) and the other way round (shipped), twice each ~2 min
#   qwen-norm-kernel-ab   qwen_block_variants.py: the B=16 block as the rollout compiles it, with and
#                      without the modulated-norm kernel, with its top kernels                  ~1.5 min
#   cuda-graph-ab / cuda-graph-ab-sd35   benchmarks/cuda_graph_ab.py: the compiled Qwen-Image
#                      (SD3.5-medium) forward at 1 and 16 rows, launched directly vs replayed
#                      from a CUDA graph, alternating, one GPU                               ~2 min each
#   cuda-graph-ab-sd35-recipe   the same for SD3.5-medium as its recipe rolls out: 32 rows (16
#                      samples with CFG), the recipe's rank-32 LoRA (would the rollout's idle
#                      quarter go with graphs?)                                              ~2 min
#   qwen-rounding-ab   the compiled Qwen-Image rollout with compile rounding eager, then
#                      fused, one after the other on one GPU                                 ~5 min
#   qwen-compiled-fused / qwen-cfg-compiled-fused   qwen-compiled / qwen-cfg-compiled with
#                      --compile-rounding fused                                              ~3 min each
#   sd35-quick / qwen-quick   eager modes only, fewer samples (a first look, ~2 min each)
#   dist-1gpu `torchrun --nproc-per-node 1 -m flowrl train` through NCCL, 2 training steps each of
#             random-weight models at real size (model.path=random:<arch>): SD3.5-medium LoRA,
#             SD3.5-medium full fine-tuning (FSDP2, a sharded checkpoint), Qwen-Image LoRA; the
#             step timings and peak memory from each run's metrics.jsonl (NPROC=K: K ranks, the
#             same per-GPU batch)                                                          ~5-7 min
#   dist-cpu-smoke  dist-1gpu's runs on the tiny SD3 model, 2 gloo ranks on the CPU
#   z-image   Z-Image rollout: 16 samples, 50 steps (ZImagePipeline's default), CFG 5.0 (the
#             pipeline's guidance 4.0, as the Z-Image recipe), eager + compiled, 1 repeat    ~7-9 min
#   z-image-compiled   the z-image rollout, compiled engine modes only, 3 repeats, a profile ~5-6 min
#   z-image-logprob    the Z-Image bf16 log-prob gap at the recipe's settings (10 steps, CFG 5,
#             noise 1.0, SDE window 2, LoRA rank 64, bf16 autocast, gradient checkpointing,
#             compiled, old_log_prob recompute; micro-batches 1, 8, 16) and the training step
#             at the recipe's micro-batch 8 (16 rows)                                        ~5-7 min
#   z-image-smoke the z-image bench at its published widths with one main block, eager, 64 px:
#             checks the z-image builder and its pipeline baseline on any machine (CPU: ~2 min)
#   cpu-smoke tiny models, to check this script on any machine
#
# Writes $OUT/<suite>-rollout.json, $OUT/<suite>-logprob.json (rewritten after every
# measurement, so a run cut short keeps what it measured), $OUT/log.txt, and prints a markdown
# summary of every JSON last. Each bench gets a `timeout` inside the overall budget
# (BENCH_BUDGET_S, default 540 s) so the script always ends, and summarizes, on its own.
# With GPUS=2 (a machine with two GPUs) the suites are spread over the two GPUs and run
# at the same time, one log per GPU. They share the host's CPUs: a host-bound figure (the
# compiled training step at small micro-batches) moves with the other suite's load, while the
# GPU-bound rollout figures do not; time host-bound work with GPUS=1.
set -u
START=$SECONDS
BUDGET=${BENCH_BUDGET_S:-540}
OUT=${OUT:-/tmp/flowrl-bench}
mkdir -p "$OUT"
# A machine without a package index gets the pure-Python wheels flowrl needs from .whl/
# (benchmarks/README.md); elsewhere the installed environment is used as it is.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install from .whl/ failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,power.limit,clocks.max.sm,memory.total --format=csv | tee -a "$OUT/log.txt"
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" | tee -a "$OUT/log.txt"

# within_budget NAME CAP LOG: sets LIMIT to CAP or what the budget has left; fails (and logs the
# skip) when under 30 s are left.
within_budget() {
  local left=$(( BUDGET - (SECONDS - START) - 20 ))
  LIMIT=$(( $2 < left ? $2 : left ))
  if (( LIMIT < 30 )); then echo "[gpu_suites] skip $1: ${left}s left in the budget" | tee -a "$3"; return 1; fi
}

# run NAME CAP_SECONDS LOG ARGS...: `flowrl bench ARGS --json $OUT/NAME.json` (replaced on a rerun), within the budget.
run() {
  local name=$1 cap=$2 log=$3; shift 3
  within_budget "$name" "$cap" "$log" || return 0
  echo "[gpu_suites] $name (limit ${LIMIT}s): flowrl bench $*" | tee -a "$log"
  timeout -k 10 "$LIMIT" python3 -m flowrl.cli bench "$@" --json "$OUT/$name.json" --overwrite >>"$log" 2>&1
  echo "[gpu_suites] $name exit $? after $(( SECONDS - START ))s" | tee -a "$log"
}

# script NAME CAP LOG ARGS...: `python3 ARGS` (a benchmarks/ script), logged, within the budget.
script() {
  local name=$1 cap=$2 log=$3; shift 3
  within_budget "$name" "$cap" "$log" || return 0
  echo "[gpu_suites] python3 $* (limit ${LIMIT}s)" | tee -a "$log"
  timeout -k 10 "$LIMIT" python3 "$@" 2>&1 | grep -v USDT >>"$log"
  echo "[gpu_suites] $name exit ${PIPESTATUS[0]}" | tee -a "$log"
}

# `flowrl bench train` on random weights: a weight-free reward and the embedded prompts in place of
# the recipes' OCR reward and prompt files.
RANDOM_RUN="reward.name=jpeg_compressibility data.train_path=null data.val_path=null"
# The GPU tests of tests/trainer/test_gpu.py that suite tests-trainer-update runs (tests-trainer the others)
TRAINER_UPDATE_TESTS="waits_for_the_device or merged_rollouts or merge_rounding or auto_checkpointing"

# dist_train NAME CAP LOG MODEL SIZE OVERRIDES...: 2 training steps of `torchrun --nproc-per-node
# ${NPROC:-1} -m flowrl train` (NCCL on GPUs, gloo on the CPU; 2 prompts x 4 samples per rank) into
# $OUT/NAME, within the budget, then one [bench] line per step from its metrics.jsonl.
dist_train() {
  local name=$1 cap=$2 log=$3 model=$4 size=$5 nproc=${NPROC:-1}; shift 5
  within_budget "$name" "$cap" "$log" || return 0
  echo "[gpu_suites] $name (limit ${LIMIT}s): torchrun --nproc-per-node $nproc -m flowrl train model.path=$model $*" | tee -a "$log"
  timeout -k 10 "$LIMIT" python3 -m torch.distributed.run --nproc-per-node "$nproc" --master-addr 127.0.0.1 \
    --master-port $(( 29500 + RANDOM % 2000 )) --local-addr 127.0.0.1 -m flowrl train model.path="$model" \
    trainer.output_dir="$OUT/$name" trainer.overwrite=true trainer.total_steps=2 trainer.prompts_per_step=$(( 2 * nproc )) \
    rollout.n=4 rollout.sampling.height="$size" rollout.sampling.width="$size" rollout.sampling.sde_window_size=2 \
    trainer.val_every=0 trainer.save_every=2 reward.name=jpeg_compressibility logging.tensorboard=false \
    logging.progress_bar=false "$@" >>"$log" 2>&1
  echo "[gpu_suites] $name exit $? after $(( SECONDS - START ))s" | tee -a "$log"
  python3 - "$name" "$OUT/$name/metrics.jsonl" <<'PY' | tee -a "$log"
import json, sys
from pathlib import Path

name, path = sys.argv[1], Path(sys.argv[2])
for r in (json.loads(line) for line in path.read_text().splitlines()) if path.is_file() else []:
    print(f"[bench] {name} step {r['step']}: {r['timing/step_s']:.1f} s (rollout {r['timing/rollout_s']:.1f} s, "
          f"update {r.get('timing/update_s', 0):.1f} s), peak {r.get('memory/peak_gb', 0):.1f} GB, reward {r['reward/mean']:.4f}")
PY
}

# dist_suite MODEL_SD35 MODEL_QWEN SIZE STEPS LOG OVERRIDES...: dist-1gpu's three runs.
dist_suite() {
  local sd35=$1 qwen=$2 size=$3 steps=$4 log=$5; shift 5
  dist_train dist-sd35-lora 150 "$log" "$sd35" "$size" rollout.sampling.num_inference_steps="$steps" \
    trainer.lora.enabled=true trainer.lora.rank=32 trainer.micro_batch_size=4 "$@"
  dist_train dist-sd35-full 180 "$log" "$sd35" "$size" rollout.sampling.num_inference_steps="$steps" \
    trainer.lora.enabled=false trainer.micro_batch_size=4 trainer.lr=1e-5 "$@"
  dist_train dist-qwen-lora 200 "$log" "$qwen" "$size" rollout.sampling.num_inference_steps="$steps" \
    trainer.lora.enabled=true trainer.lora.rank=64 trainer.micro_batch_size=2 trainer.gradient_checkpointing=true "$@"
}

suite() {
  local log=$1 s=$2
  case $s in
    tests|tests-trainer)
      local dirs cap=420
      dirs=$(ls -d tests/bench tests/benchmarks tests/models tests/accel 2>/dev/null | tr '\n' ' ')
      local select=()
      # tests-trainer leaves the tests of its own suites to them (tests-trainer-update, tests-cuda-graphs)
      [[ $s == tests-trainer ]] && dirs=tests/trainer cap=540 select=(-k "not ($TRAINER_UPDATE_TESTS or cuda_graphs)")
      within_budget "$s" $cap "$log" || return 0
      echo "[gpu_suites] pytest -m gpu $dirs ${select[*]} (limit ${LIMIT}s)" | tee -a "$log"
      timeout -k 10 "$LIMIT" python3 -m pytest -q -s -p no:cacheprovider -m gpu $dirs "${select[@]}" >>"$log" 2>&1
      echo "[gpu_suites] $s exit $?" | tee -a "$log" ;;
    tests-trainer-update)
      within_budget "$s" 480 "$log" || return 0
      echo "[gpu_suites] pytest -m gpu tests/trainer/test_gpu.py -k '$TRAINER_UPDATE_TESTS' (limit ${LIMIT}s)" | tee -a "$log"
      timeout -k 10 "$LIMIT" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/trainer/test_gpu.py \
        -k "$TRAINER_UPDATE_TESTS" >>"$log" 2>&1
      echo "[gpu_suites] $s exit $?" | tee -a "$log" ;;
    tests-cuda-graphs)
      within_budget "$s" 200 "$log" || return 0
      echo "[gpu_suites] pytest -m gpu trainer.cuda_graphs (limit ${LIMIT}s)" | tee -a "$log"
      timeout -k 10 "$LIMIT" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/trainer/test_cuda_graphs.py \
        >>"$log" 2>&1
      echo "[gpu_suites] $s exit $?" | tee -a "$log" ;;
    tests-checkpointing)
      within_budget "$s" 150 "$log" || return 0
      echo "[gpu_suites] pytest -m gpu trainer.gradient_checkpointing=auto (limit ${LIMIT}s)" | tee -a "$log"
      timeout -k 10 "$LIMIT" python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/trainer/test_gpu.py \
        -k auto_checkpointing >>"$log" 2>&1
      echo "[gpu_suites] $s exit $?" | tee -a "$log" ;;
    sd35)
      run sd35-rollout 330 "$log" rollout --model sd35-medium -n 16 --steps 10 --size 512 --compile --repeats 3 \
        --profile engine-batched-compiled --profile-steps 2
      run sd35-logprob 200 "$log" logprob --model sd35-medium -n 32 --steps 10 --size 512 --micro-batches 1,8,32 ;;
    qwen)
      run qwen-rollout 540 "$log" rollout --model qwen-image -n 16 --steps 50 --size 512 --compile --serial-samples 2 \
        --repeats 1 --profile engine-batched-compiled --profile-steps 2 ;;
    flux)
      run flux-rollout 540 "$log" rollout --model flux-dev -n 16 --steps 28 --size 512 --guidance-scale 3.5 --compile \
        --serial-samples 2 --repeats 1 ;;
    flux-vs-pipeline)
      run flux-vs-pipeline 420 "$log" rollout --model flux-dev -n 16 --steps 28 --size 512 --guidance-scale 3.5 \
        --compile --repeats 2 --modes pipeline-batched,engine-batched-compiled --profile engine-batched-compiled \
        --profile-steps 2 ;;
    flux-logprob)
      run flux-logprob 520 "$log" logprob --model flux-dev -n 16 --steps 6 --size 512 --guidance-scale 3.5 \
        --noise-level 0.9 --lora-rank 64 --autocast bf16 --compile --gradient-checkpointing --micro-batches 1,8 \
        --train-micro-batch 3 --old-log-prob recompute ;;
    sd35-large)
      run sd35-large-rollout 540 "$log" rollout --model sd35-large -n 16 --steps 10 --size 512 --guidance-scale 4.5 \
        --compile --serial-samples 4 --repeats 1 ;;
    sd35-large-vs-pipeline)
      run sd35-large-vs-pipeline 540 "$log" rollout --model sd35-large -n 16 --steps 10 --size 512 --guidance-scale 4.5 \
        --compile --repeats 1 --modes pipeline-batched,engine-batched-compiled,engine-concurrent-compiled ;;
    z-image-vs-pipeline)
      run z-image-vs-pipeline 420 "$log" rollout --model z-image -n 16 --steps 50 --size 512 --guidance-scale 5.0 \
        --compile --repeats 1 --modes pipeline-batched,engine-batched-compiled ;;
    sd35-large-logprob)
      run sd35-large-logprob 520 "$log" logprob --model sd35-large -n 16 --steps 10 --size 512 --guidance-scale 4.5 \
        --lora-rank 32 --autocast bf16 --compile --gradient-checkpointing --micro-batches 1,8 --train-micro-batch 4 \
        --old-log-prob recompute --kl-beta 0.04 ;;
    qwen-cfg)
      run qwen-cfg-rollout 420 "$log" rollout --model qwen-image -n 16 --steps 50 --size 512 --guidance-scale 4.0 \
        --modes pipeline-batched,engine-batched,engine-batched-compiled --repeats 1
      # No CFG here: with grad enabled a Qwen-Image row keeps ~9 GB of activations, so 8 rows
      # (+ 41 GB of weights) is the largest micro-batch that fits.
      run qwen-logprob 150 "$log" logprob --model qwen-image -n 8 --steps 10 --size 512 \
        --micro-batches 1,4,8 --sde-window-size 2 --train-micro-batch 2 ;;
    qwen-compiled)
      run qwen-compiled-rollout 330 "$log" rollout --model qwen-image -n 16 --steps 50 --size 512 --compile \
        --modes engine-batched-compiled,engine-concurrent-compiled --repeats 3 --profile engine-batched-compiled --profile-steps 8 ;;
    qwen-cfg-compiled)
      run qwen-cfg-compiled-rollout 330 "$log" rollout --model qwen-image -n 16 --steps 50 --size 512 --guidance-scale 4.0 \
        --compile --modes engine-batched-compiled --repeats 1 ;;
    qwen-compiled-lora)
      run qwen-compiled-lora-rollout 300 "$log" rollout --model qwen-image -n 16 --steps 50 --size 512 --compile \
        --lora-rank 32 --modes engine-batched-compiled --repeats 2 --profile engine-batched-compiled --profile-steps 4 ;;
    qwen-logprob-compiled-full)
      run qwen-logprob-compiled-full 300 "$log" logprob --model qwen-image -n 8 --steps 10 --size 512 \
        --micro-batches 1,4 --sde-window-size 2 --train-micro-batch 1 --compile --lora-rank 0 --profile ;;
    qwen-train-step)
      run qwen-train-step 300 "$log" logprob --model qwen-image -n 4 --steps 10 --size 512 --micro-batches 1,2 \
        --sde-window-size 2 --train-micro-batch 2 --compile --gradient-checkpointing --autocast bf16 \
        --guidance-scale 4.0 --old-log-prob recompute --profile ;;
    qwen-train-micro-batches)
      run qwen-train-micro-batches 360 "$log" logprob --model qwen-image -n 8 --steps 10 --size 512 --micro-batches 2 \
        --sde-window-size 2 --train-micro-batches 2,4,8 --lora-rank 64 --compile --gradient-checkpointing \
        --autocast bf16 --guidance-scale 4.0 --old-log-prob recompute --profile ;;
    qwen-train-step-eager)
      run qwen-train-step-eager 240 "$log" logprob --model qwen-image -n 4 --steps 10 --size 512 --micro-batches 2 \
        --sde-window-size 2 --train-micro-batch 2 --gradient-checkpointing --autocast bf16 --guidance-scale 4.0 \
        --old-log-prob recompute ;;
    sd35-train-step|sd35-train-step-eager)
      local compiled="--compile --profile"; [[ $s == *-eager ]] && compiled=""
      # shellcheck disable=SC2086  # $compiled is a list of flags
      run $s 520 "$log" logprob --model sd35-medium -n 8 --steps 10 --size 512 --micro-batches 8 \
        --train-micro-batch 8 --gradient-checkpointing --autocast bf16 --guidance-scale 4.5 --old-log-prob recompute \
        --kl-beta 0.04 $compiled ;;
    sd35-train-step-graphs)  # the SD3.5 recipe's compiled training step without, then with CUDA graphs
      run $s 560 "$log" logprob --model sd35-medium -n 8 --steps 10 --size 512 --micro-batches 8 \
        --train-micro-batch 8 --autocast bf16 --guidance-scale 4.5 --old-log-prob recompute --kl-beta 0.04 \
        --compile --cuda-graphs both --train-repeats 5 ;;
    qwen-train-step-graphs)  # the Qwen recipe's compiled training step (micro-batch 4) without, then with CUDA graphs
      run $s 560 "$log" logprob --model qwen-image -n 4 --steps 10 --size 512 --micro-batches 4 --sde-window-size 2 \
        --train-micro-batch 4 --lora-rank 64 --autocast bf16 --guidance-scale 4.0 --old-log-prob recompute \
        --compile --cuda-graphs both --train-repeats 5 ;;
    train-step)
      suite "$log" train-step-qwen
      suite "$log" train-step-sd35-eager ;;
    train-step-qwen|train-step-qwen-graphs|train-step-qwen-workspace|train-step-qwen-merged)
      local graphs=""; [[ $s == *-graphs ]] && graphs="trainer.cuda_graphs=true"
      [[ $s == *-merged ]] && graphs="rollout.merge_lora=true"
      # cuBLASLt's workspace in KiB (PyTorch's default on Hopper: 32768); larger lets split-K GEMMs
      # reduce through it rather than zero their output with a memset first
      # shellcheck disable=SC2086  # $RANDOM_RUN, $graphs and $OVERRIDES are lists of overrides
      ( [[ $s == *-workspace ]] && export CUBLASLT_WORKSPACE_SIZE=${WORKSPACE_KIB:-262144}
      run $s 540 "$log" train --config recipes/qwen_image_ocr_lora.yaml model.path=random:qwen-image \
        $RANDOM_RUN trainer.prompts_per_step=2 $graphs ${OVERRIDES:-} --steps "${STEPS:-1}" --peer-steps "${PEER_STEPS:-1}" \
        ${PROFILE:+--profile} ) ;;
    train-step-qwen-ocr)
      python3 -m flowrl.cli data ocr --num 256 --out "$OUT/ocr_train.jsonl" --seed 0 >>"$log" 2>&1
      run train-step-qwen-ocr 540 "$log" train --config recipes/qwen_image_ocr_lora.yaml model.path=random:qwen-image \
        data.train_path="$OUT/ocr_train.jsonl" data.val_path=null algorithm.zero_std_policy=keep \
        trainer.prompts_per_step=2 --steps 1 --peer-steps 0 --profile ;;
    train-step-sd35|train-step-sd35-eager|train-step-sd35-steps3|train-step-sd35-graphs|train-step-sd35-merged)
      local variant=""
      [[ $s == *-merged ]] && variant="rollout.merge_lora=true"
      [[ $s == *-eager ]] && variant="engine.compile=false"
      [[ $s == *-steps3 ]] && variant="trainer.steps_per_forward=3"
      [[ $s == *-graphs ]] && variant="trainer.cuda_graphs=true"
      # shellcheck disable=SC2086  # $RANDOM_RUN, $variant and $OVERRIDES are lists of overrides
      run $s 540 "$log" train --config recipes/sd35_medium_ocr_lora.yaml model.path=random:sd35-medium \
        $RANDOM_RUN trainer.prompts_per_step=1 $variant ${OVERRIDES:-} --steps "${STEPS:-1}" --peer-steps "${PEER_STEPS:-1}" \
        ${PROFILE:+--profile} ;;
    tiny-qwen-gap-variants)  # the tiny Qwen-Image's gap on CUDA, one setting changed at a time
      local i=0 v
      for v in "--compile" "--compile --guidance-scale 2.0" "--compile --autocast bf16" "--compile --gradient-checkpointing" \
               "--compile --guidance-scale 2.0 --autocast bf16 --gradient-checkpointing" "--compile --lora-rank 0 --autocast bf16" \
               "--guidance-scale 2.0 --autocast bf16 --gradient-checkpointing"; do
        i=$((i + 1))
        # shellcheck disable=SC2086  # $v is a list of flags
        run tiny-qwen-gap-$i 120 "$log" logprob --model tiny-qwen --dtype bfloat16 -n 4 --steps 6 --size 64 \
          --micro-batches 1,4 --lora-rank 4 --train-repeats 1 --peak-seconds 0.05 $v
      done ;;
    lora-gemm-gaps)
      script "$s" 150 "$log" benchmarks/lora_gemm_gaps.py ;;
    lora-gemm-gaps-sustained)  # 700 blocks queued (18 s of GEMMs), the card's clocks, power and their limits logged
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_event_reasons.active,clocks_event_reasons.sw_power_cap \
        --format=csv -lms 250 >"$OUT/$s-clocks.csv" 2>&1 &
      local smi=$!
      script "$s" 150 "$log" benchmarks/lora_gemm_gaps.py --blocks 1 --sync-every --ahead --deep-blocks 700
      kill "$smi"
      echo "[gpu_suites] $s: SM clock and power while busy (samples drawing over 300 W: count, clock, power-cap state), from $OUT/$s-clocks.csv" | tee -a "$log"
      awk -F', ' 'NR > 1 && $3 + 0 > 300 {print $2, "power cap", $5}' "$OUT/$s-clocks.csv" | sort | uniq -c | sort -rn | head -5 \
        | tee -a "$log" ;;
    checkpoint-ab)
      script "$s" 300 "$log" benchmarks/checkpoint_host_time.py --model qwen-image --samples 1 --size 512 --lora-rank 32 ;;
    qwen-gemm-shapes)
      script "$s" 200 "$log" benchmarks/qwen_gemm_shapes.py --rows 16 ;;
    qwen-floor|qwen-floor-autotune)
      local autotune=0; [[ $s == *-autotune ]] && autotune=1
      TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=$autotune script "$s" 300 "$log" benchmarks/floor.py --model qwen-image -n 16 \
        --steps 50 --size 512 --compile --json "$OUT/$s.json" ;;
    train-floors|train-floors-qwen|train-floors-sd35)
      local qwen_lora="to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out"
      qwen_lora="$qwen_lora,img_mlp.net.0.proj,img_mlp.net.2,txt_mlp.net.0.proj,txt_mlp.net.2"
      local qwen=(--model qwen-image --guidance-scale 4.0 --max-sequence-length 256 --lora-rank 64 --lora-targets "$qwen_lora")
      local sd35=(--model sd35-medium --guidance-scale 4.5 --max-sequence-length 128 --lora-rank 32)
      local common=(--size 512 --seconds 2 --peak-seconds 3)
      if [[ $s != train-floors-sd35 ]]; then
        script qwen-train-floor 150 "$log" benchmarks/floor.py "${qwen[@]}" -n 4 --train "${common[@]}" \
          --json "$OUT/qwen-train-floor.json"
        script qwen-rollout-floor 150 "$log" benchmarks/floor.py "${qwen[@]}" -n 32 "${common[@]}" \
          --json "$OUT/qwen-rollout-floor.json"
      fi
      if [[ $s != train-floors-qwen ]]; then
        script sd35-train-floor 120 "$log" benchmarks/floor.py "${sd35[@]}" -n 8 --train "${common[@]}" \
          --json "$OUT/sd35-train-floor.json"
        script sd35-rollout-floor 120 "$log" benchmarks/floor.py "${sd35[@]}" -n 16 "${common[@]}" \
          --json "$OUT/sd35-rollout-floor.json"
      fi ;;
    qwen-logprob-compiled)
      run qwen-logprob-compiled 240 "$log" logprob --model qwen-image -n 8 --steps 10 --size 512 \
        --micro-batches 1,4,8 --sde-window-size 2 --train-micro-batch 2 --compile ;;
    sd35-compiled)
      run sd35-compiled-rollout 420 "$log" rollout --model sd35-medium -n 16 --steps 10 --size 512 --compile --repeats 3 \
        --modes pipeline-batched,engine-batched-compiled,engine-concurrent-compiled ;;
    qwen-vae-decode)
      script "$s" 150 "$log" benchmarks/qwen_vae_decode.py --rows 16 --size 512 ;;
    qwen-block-variants)
      script "$s" 300 "$log" benchmarks/qwen_block_variants.py --rows 16 --seconds 2 ;;
    qwen-forward-ab|qwen-forward-ab-fused)
      local rounding=eager; [[ $s == *-fused ]] && rounding=fused
      script "$s" 300 "$log" benchmarks/qwen_forward_ab.py --rows 16 --compile-rounding $rounding ;;
    qwen-joint-kernel-ab)
      script "$s" 300 "$log" benchmarks/qwen_block_variants.py --rows 16 --seconds 2 --top 14 \
        --variants "sequence-major:eager,sequence-major:eager:joint_v=0,sequence-major:eager:joint_kernel=0" ;;
    qwen-table-kernel-ab)
      script "$s" 330 "$log" benchmarks/qwen_forward_ab.py --compare table-kernel --rows 16 ;;
    qwen-lora-block)
      script "$s" 240 "$log" benchmarks/qwen_block_variants.py --rows 16 --seconds 2 --top 40 \
        --variants "sequence-major:eager,sequence-major:eager:lora=32,sequence-major:eager:lora=32:lora_fold=0" ;;
    qwen-lora-block-recipe)  # one block as the Qwen recipe's training rollout compiles it: 64 rows, masked, LoRA 64 incl. MLPs
      script "$s" 300 "$log" benchmarks/qwen_block_variants.py --rows 64 --text-mask --seconds 3 --top 12 \
        --variants "sequence-major:eager:lora=64:lora_mlp=1,sequence-major:eager:lora=64:lora_mlp=1:lora_first=0,sequence-major:eager:lora=64:lora_mlp=1:lora_fold=0,sequence-major:eager" ;;
    qwen-lora-block-launch)  # the recipe's LoRA block launched directly, synced after each call, replayed as a CUDA graph
      local lora="sequence-major:eager:lora=64:lora_mlp=1"
      script "$s" 300 "$log" benchmarks/qwen_block_variants.py --rows 64 --text-mask --seconds 3 --top 6 \
        --launch direct,synced,graph --variants "$lora,$lora:lora_fold=0" --code-dir "$OUT/$s-code"
      ( export CUBLASLT_WORKSPACE_SIZE=${WORKSPACE_KIB:-262144}
      script "$s-workspace" 200 "$log" benchmarks/qwen_block_variants.py --rows 64 --text-mask --seconds 3 --top 6 \
        --variants "$lora,$lora:lora_fold=0" ) ;;
    lora-joint-k)  # the recipe's LoRA projections folded against GEMMs over [x | x A^T]
      script "$s" 150 "$log" benchmarks/lora_joint_k.py ;;
    qwen-lora-gelu-ab)  # the recipe's LoRA block with its MLP's GELU in the folded op's epilogue, and as a pass of its own
      local lora="sequence-major:eager:lora=64:lora_mlp=1"
      script "$s" 240 "$log" benchmarks/qwen_block_variants.py --rows 64 --text-mask --seconds 3 --top 8 \
        --variants "$lora,$lora:gelu_epilogue=0,$lora,$lora:gelu_epilogue=0" ;;
    qwen-train-block)  # one block's training forward + backward as the trainer compiles it, against its no-grad forward
      script "$s" 300 "$log" benchmarks/qwen_train_block.py --rows 8 --text-mask --seconds 3 --top 14 ;;
    qwen-train-block-memsets)
      local lora="sequence-major:eager:lora=64:lora_mlp=1"
      script "$s" 360 "$log" benchmarks/qwen_train_block.py --rows 8 --seconds 3 --top 14 \
        --variants "$lora,sequence-major:eager,$lora:sdpa=cudnn,$lora:sdpa=flash" ;;
    gemm-memsets)
      script "$s" 90 "$log" benchmarks/gemm_memsets.py ;;
    attention-backends)
      script "$s" 120 "$log" benchmarks/attention_backends.py ;;
    cublaslt-memsets)
      script "$s" 180 "$log" benchmarks/cublaslt_algos.py --rows 8 --problems img-proj,img-mlp-up-bias,img-mlp-down ;;
    qwen-train-block-combo)
      local lora="sequence-major:eager:lora=64:lora_mlp=1"
      script "$s" 300 "$log" benchmarks/qwen_train_block.py --rows 8 --seconds 3 --top 14 \
        --variants "$lora,$lora:combo_kernels=1" ;;
    lora-merge-time)
      script "$s" 240 "$log" benchmarks/lora_merge_time.py --seconds 2 ;;
    qwen-train-block-autotune)
      local lora="sequence-major:eager:lora=64:lora_mlp=1"
      script "$s" 560 "$log" benchmarks/qwen_train_block.py --rows 8 --seconds 3 --top 14 \
        --variants "$lora,$lora:max_autotune_gemm=1" ;;
    qwen-train-block-tuning)
      local lora="sequence-major:eager:lora=64:lora_mlp=1"
      TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 script "$s" 300 "$log" benchmarks/qwen_train_block.py --rows 8 \
        --seconds 3 --top 6 --variants "$lora,$lora:coordinate_descent_tuning=0" ;;
    qwen-text-mask-attention)  # a padded batch's joint attention: masked, one call per run of equal lengths, unmasked
      script "$s" 150 "$log" benchmarks/qwen_text_mask_attention.py --seconds 3 ;;
    qwen-prefix-attention-ab)  # the recipe's LoRA block with padded text: attention per run of equal lengths, and masked
      local lora="sequence-major:eager:lora=64:lora_mlp=1"
      script "$s" 240 "$log" benchmarks/qwen_block_variants.py --rows 64 --text-mask --seconds 3 --top 6 \
        --variants "$lora,$lora:prefix_attention=0,$lora,$lora:prefix_attention=0"
      script "$s-train" 300 "$log" benchmarks/qwen_train_block.py --rows 8 --text-mask --seconds 3 --top 6 \
        --variants "$lora,$lora:prefix_attention=0" ;;
    qwen-lora-order)
      script "$s" 240 "$log" benchmarks/qwen_block_variants.py --rows 16 --seconds 3 --top 12 \
        --variants "sequence-major:eager:lora=32:lora_first=0,sequence-major:eager:lora=32:lora_first=1,sequence-major:eager:lora=32:lora_first=0,sequence-major:eager:lora=32:lora_first=1" ;;
    qwen-norm-kernel-ab)
      script "$s" 240 "$log" benchmarks/qwen_block_variants.py --rows 16 --seconds 2 --top 16 \
        --variants "sequence-major:eager,sequence-major:eager:norm_kernel=0" ;;
    cuda-graph-ab|cuda-graph-ab-sd35)
      local model=qwen-image; [[ $s == *-sd35 ]] && model=sd35-medium
      script "$s" 240 "$log" benchmarks/cuda_graph_ab.py --model $model --rows 1,16 ;;
    cuda-graph-ab-sd35-recipe)
      script "$s" 240 "$log" benchmarks/cuda_graph_ab.py --model sd35-medium --rows 32 --lora-rank 32 ;;
    qwen-rounding-ab)  # the compiled no-CFG rollout with each compile rounding, one after the other on one GPU
      for r in eager fused; do
        run qwen-rounding-$r-rollout 200 "$log" rollout --model qwen-image -n 16 --steps 50 --size 512 --compile \
          --compile-rounding $r --modes engine-batched-compiled --repeats 2 --peak-seconds 2
      done ;;
    qwen-compiled-fused)
      run qwen-compiled-fused-rollout 240 "$log" rollout --model qwen-image -n 16 --steps 50 --size 512 --compile \
        --compile-rounding fused --modes engine-batched-compiled,engine-concurrent-compiled --repeats 2 ;;
    qwen-cfg-compiled-fused)
      run qwen-cfg-compiled-fused-rollout 240 "$log" rollout --model qwen-image -n 16 --steps 50 --size 512 \
        --guidance-scale 4.0 --compile --compile-rounding fused --modes engine-batched-compiled --repeats 1 ;;
    z-image)
      run z-image-rollout 540 "$log" rollout --model z-image -n 16 --steps 50 --size 512 --guidance-scale 5.0 \
        --compile --serial-samples 2 --repeats 1 --profile engine-batched-compiled --profile-steps 2 ;;
    z-image-compiled)
      run z-image-compiled-rollout 360 "$log" rollout --model z-image -n 16 --steps 50 --size 512 --guidance-scale 5.0 \
        --compile --modes engine-batched-compiled,engine-concurrent-compiled --repeats 3 \
        --profile engine-batched-compiled --profile-steps 4 ;;
    z-image-logprob)
      run z-image-logprob 420 "$log" logprob --model z-image -n 16 --steps 10 --size 512 --guidance-scale 5.0 \
        --noise-level 1.0 --sde-window-size 2 --micro-batches 1,8,16 --lora-rank 64 --compile --autocast bf16 \
        --gradient-checkpointing --old-log-prob recompute --train-micro-batch 8 ;;
    z-image-smoke)
      run z-image-smoke-rollout 240 "$log" rollout --model z-image --num-layers 1 -n 2 --steps 2 --size 64 \
        --guidance-scale 5.0 --modes pipeline-batched,engine-batched --warmup-steps 1 --peak-seconds 0.1 ;;
    sd35-quick)
      run sd35-quick-rollout 150 "$log" rollout --model sd35-medium -n 8 --steps 10 --size 512 --serial-samples 4 ;;
    qwen-quick)
      run qwen-quick-rollout 200 "$log" rollout --model qwen-image -n 8 --steps 20 --size 512 --serial-samples 1 ;;
    dist-1gpu)
      dist_suite random:sd35-medium random:qwen-image 512 10 "$log" model.dtype=bfloat16 trainer.mixed_precision=bf16 ;;
    dist-cpu-smoke)  # dist-1gpu's runs on the tiny SD3 and Qwen-Image models, 2 gloo ranks on the CPU
      python3 -m flowrl.cli make-tiny --kind sd3 "$OUT/tiny-sd3" >>"$log" 2>&1
      python3 -m flowrl.cli make-tiny --kind qwen_image "$OUT/tiny-qwen" >>"$log" 2>&1
      NPROC=2 GLOO_SOCKET_IFNAME=lo dist_suite "$OUT/tiny-sd3" "$OUT/tiny-qwen" 64 4 "$log" ;;
    cpu-smoke)  # checks this script itself anywhere (tiny models, seconds)
      run smoke-rollout 120 "$log" rollout --model tiny-sd3 -n 3 --steps 3 --size 64 --compile --compile-backend aot_eager \
        --peak-seconds 0.1 --profile pipeline-batched --profile-steps 1
      run smoke-logprob 120 "$log" logprob --model tiny-qwen -n 4 --steps 3 --size 64 --micro-batches 1,4 --peak-seconds 0.1 \
        --gradient-checkpointing --profile
      # shellcheck disable=SC2086  # $RANDOM_RUN is a list of overrides
      run smoke-train 120 "$log" train --config recipes/qwen_image_ocr_lora.yaml model.path=random:tiny-qwen $RANDOM_RUN \
        trainer.prompts_per_step=2 rollout.n=2 rollout.sampling.height=64 rollout.sampling.width=64 \
        rollout.sampling.num_inference_steps=6 engine.compile=false model.max_sequence_length=16 --steps 1 --peak-seconds 0.1
      script smoke-floor 120 "$log" benchmarks/floor.py --model tiny-qwen -n 4 --steps 3 --size 64 --compile \
        --compile-backend aot_eager --seconds 0.1 --peak-seconds 0.1 --json "$OUT/smoke-floor.json"
      script smoke-train-floor 120 "$log" benchmarks/floor.py --model tiny-sd3 -n 2 --size 64 --guidance-scale 4.5 \
        --lora-rank 4 --train --seconds 0.1 --peak-seconds 0.1 --json "$OUT/smoke-train-floor.json"
      run smoke-flux-rollout 120 "$log" rollout --model tiny-flux -n 2 --steps 2 --size 64 --guidance-scale 3.5 \
        --true-cfg-scale 2.0 --peak-seconds 0.1 --modes pipeline-batched,engine-batched
      run smoke-flux-logprob 120 "$log" logprob --model tiny-flux -n 2 --steps 3 --size 64 --guidance-scale 3.5 \
        --micro-batches 1,2 --peak-seconds 0.1 --train-repeats 1
      run smoke-z-image-rollout 120 "$log" rollout --model tiny-z-image -n 3 --steps 3 --size 64 --guidance-scale 5.0 \
        --compile --compile-backend aot_eager --peak-seconds 0.1
      run smoke-z-image-logprob 120 "$log" logprob --model tiny-z-image -n 4 --steps 4 --size 64 --guidance-scale 5.0 \
        --noise-level 1.0 --sde-window-size 2 --micro-batches 1,4 --lora-rank 4 --autocast bf16 \
        --gradient-checkpointing --old-log-prob recompute --train-micro-batch 2 --peak-seconds 0.1 ;;
    *) echo "[gpu_suites] unknown suite $s (tests, sd35, qwen, qwen-cfg, flux, sd35-large, z-image, sd35-quick, qwen-quick)" | tee -a "$log" ;;
  esac
}

if [[ "${GPUS:-1}" == 2 ]]; then
  # Two GPUs: alternate suites between them, both queues at once.
  # SUITE0 / SUITE1 (space-separated) pin suites to a GPU; otherwise the arguments alternate.
  queue0=(); queue1=(); i=0
  for s in "$@"; do if (( i % 2 == 0 )); then queue0+=("$s"); else queue1+=("$s"); fi; i=$((i + 1)); done
  if [[ -n "${SUITE0:-}${SUITE1:-}" ]]; then read -ra queue0 <<<"${SUITE0:-}"; read -ra queue1 <<<"${SUITE1:-}"; fi
  ( export CUDA_VISIBLE_DEVICES=0; for s in "${queue0[@]}"; do suite "$OUT/log-gpu0.txt" "$s"; done ) &
  ( export CUDA_VISIBLE_DEVICES=1; for s in "${queue1[@]}"; do suite "$OUT/log-gpu1.txt" "$s"; done ) &
  wait
  tail -n 25 "$OUT"/log-gpu*.txt
else
  for s in "$@"; do suite "$OUT/log.txt" "$s"; done
  grep -E "^\[bench\]|Error|error|Traceback|passed|failed" "$OUT/log.txt" | tail -n 40
fi
echo
echo "== summary ($(( SECONDS - START ))s)"
if compgen -G "$OUT/*.json" >/dev/null; then python3 -m flowrl.bench.summary "$OUT"/*.json | tee "$OUT/summary.md"; fi
