#!/usr/bin/env bash
# GPU suites of flowrl: the commands behind docs/performance.md and the GPU tests, by name.
#
#   bash benchmarks/gpu_suites.sh SUITE [SUITE ...]       (from the repo root)
#
# Suites (each fits one 10-minute command on one H200; estimates):
#   tests            every GPU test (pytest -m gpu): engine, fast paths, bf16 training, log-prob gaps ~8 min
#   qwen             Qwen-Image rollout, 16 samples x 50 steps: pipeline batch 16 against the compiled
#                    engine (batched and concurrent)                                              ~6 min
#   sd35             SD3.5-medium rollout, 16 samples x 10 steps, the same modes                  ~4 min
#   sd35-large       SD3.5-large rollout, CFG 4.5, pipeline against the compiled engine           ~5 min
#   flux             FLUX.1 [dev] rollout, 28 steps, guidance 3.5, pipeline against the engine    ~5 min
#   z-image          Z-Image rollout, 50 steps, CFG 5.0, pipeline against the engine              ~4 min
#   wan              Wan2.1-1.3B rollout at Flow-GRPO's settings (240x416, 33 frames, 20 steps, CFG 4.5):
#                    pipeline batch 8 against the compiled engine (H100: 78 s)                     ~2 min
#   wan-480p         the same model at 480x832, 81 frames, 4 samples (H100: pipeline 110 s a run)  ~6 min
#   wan22-5b         Wan2.2-TI2V-5B at 704x1280, 121 frames, 2 samples (H100: pipeline 99 s a run) ~6 min
#   wan22-a14b       Wan2.2-T2V-A14B (two 14B experts, random:wan2.2-a14b) at 480x832, 33 frames, 20 steps,
#                    CFG 4.0, 2 samples: pipeline against the compiled engine, which compiles the
#                    high-noise expert only (the one a run trains; the other runs eager) (not run yet) ~6 min
#   train-step-wan   `flowrl bench train` of recipes/wan21_1_3b_ocr_lora.yaml (H100: 351 s)       ~6 min
#   train-step-wan22 the same of recipes/wan22_5b_dancegrpo_lora.yaml, no peer, one timed step after the
#                    warm-up (H100: 175 s in all, 45 s a step)                                     ~3 min
#   train-step-wan22-a14b  recipes/wan21_1_3b_ocr_lora.yaml's FlowGRPO on random:wan2.2-a14b, training its
#                    high-noise expert (model.trained_expert=high) on the 13 of 20 steps it predicts
#                    (sde_window [0, 13]), no peer (not run yet)                                    ~7 min
#   train-step-qwen  `flowrl bench train`, the Qwen-Image recipe at 2 prompts x 16, with the peer  ~7 min
#   train-step-sd35  the SD3.5-medium recipe at 1 prompt x 16, with the peer                       ~9 min
#   train-step-qwen-nft  `flowrl bench train` of recipes/qwen_image_ocr_nft.yaml at 2 prompts x 12 (no peer;
#                    needs an H200's memory: the merged rollout copy does not fit an H100's 80 GB,
#                    where OVERRIDES=rollout.merge_lora=false runs the adapter instead; H100, STEPS=1:
#                    531 s, 394 s of it the compiling warm-up)                                     ~9 min
#   train-step-sd35-nft  recipes/sd35_medium_ocr_nft.yaml at 2 prompts x 16 (no peer)              ~5 min
#   floors           benchmarks/floor.py: each recipe's training pass and rollout forward as its
#                    matrix products back to back (the least each phase could take)               ~4 min
#   dist-1gpu        torchrun --nproc-per-node 1 training steps through NCCL: SD3.5-medium LoRA and
#                    FSDP2 full fine-tuning, Qwen-Image LoRA                                       ~6 min
#   toy-make         the toy world's GPU-size model (flowrl make-toy --size gpu, run first; the
#                    machine must stay warm for the next suites, which read outputs/toy-gpu; H100: 174-224 s) ~4 min
#   toy-learn        `flowrl bench learn`: FlowGRPO full and LoRA on the GPU size and their controls,
#                    four processes at once, 420 device-s each (H100: 40 steps in 160 s)         ~9 min
#   toy-algorithms   FlowGRPO, DiffusionNFT, AWM and online DPO on the GPU size with the toy CPU
#                    recipes' algorithm settings, 40 steps, and their controls: eight processes (H100: 305 s) ~6 min
#   toy-video-make   the video toy world's GPU-size model (flowrl make-toy --size video-gpu, run first;
#                    outputs/toy-video-gpu; the machine must stay warm for the next suite; H100: 174 s)
#                    ~3 min
#   toy-video-algorithms  FlowGRPO (recipes/toy_video_gpu_full.yaml) and AWM (the video CPU recipe's
#                    settings) on it, 50 steps at the seed SEEDS (default 42), with controls, 32 clips
#                    a held-out prompt: four processes (H100: 547 s)                                ~9 min
#   cpu-smoke        this script itself on tiny models, on any machine                             ~2 min
#
# Settings: OUT (results folder, default /tmp/flowrl-bench), BENCH_BUDGET_S (each suite's time
# budget, default 540 s: every command gets a `timeout` inside it, so the script always ends),
# STEPS and PEER_STEPS (timed steps of the train-step suites), OVERRIDES ("key=value ..." added to
# the train-step suites' recipe), SEEDS (toy-algorithms' training seed, default the recipes' 42;
# one seed per command: a seed's eight processes take 5 of the 10 minutes; toy-video-algorithms'
# too: a seed's four processes take 9). Writes
# $OUT/<name>.json (rewritten after every measurement, so a run cut short keeps what it measured)
# and $OUT/log.txt.
set -u
START=$SECONDS
BUDGET=${BENCH_BUDGET_S:-540}
OUT=${OUT:-/tmp/flowrl-bench}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
# A machine without a package index gets the pure-Python wheels flowrl needs from .whl/
# (benchmarks/README.md); elsewhere the installed environment is used as it is.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install from .whl/ failed"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,power.limit,memory.total --format=csv 2>/dev/null | tee -a "$LOG"
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'cuda', torch.version.cuda)" | tee -a "$LOG"

# limit CAP: the seconds a command may take, CAP or what the budget has left (0 when under 30 s).
limit() {
  local left=$(( BUDGET - (SECONDS - START) - 20 ))
  local cap=$(( $1 < left ? $1 : left ))
  echo $(( cap < 30 ? 0 : cap ))
}

# run NAME CAP COMMAND...: COMMAND under a timeout inside the budget, logged.
run() {
  local name=$1 cap; cap=$(limit "$2"); shift 2
  if (( cap == 0 )); then echo "[gpu_suites] skip $name: the budget is spent" | tee -a "$LOG"; return 0; fi
  echo "[gpu_suites] $name (limit ${cap}s): $*" | tee -a "$LOG"
  timeout -k 10 "$cap" "$@" >>"$LOG" 2>&1
  echo "[gpu_suites] $name exit $? after $(( SECONDS - START ))s" | tee -a "$LOG"
}

bench() { local name=$1 cap=$2; shift 2; run "$name" "$cap" python3 -m flowrl.cli bench "$@" --json "$OUT/$name.json" --overwrite; }

# The whole-step suites: random weights, a weight-free reward and the embedded prompts in place of
# the recipes' OCR reward and prompt files.
RANDOM_RUN="reward.name=jpeg_compressibility data.train_path=null data.val_path=null"
# The video recipes keep their per-frame reward's form (an image reward refuses videos).
VIDEO_RUN="data.train_path=null data.val_path=null"
TIMING="--steps ${STEPS:-2} --peer-steps ${PEER_STEPS:-1}"

# dist NAME MODEL OVERRIDES...: 2 steps of torchrun --nproc-per-node ${NPROC:-1} -m flowrl train.
dist() {
  local name=$1 model=$2 nproc=${NPROC:-1}; shift 2
  run "$name" 200 python3 -m torch.distributed.run --nproc-per-node "$nproc" --master-addr 127.0.0.1 \
    --master-port $(( 29500 + RANDOM % 2000 )) --local-addr 127.0.0.1 -m flowrl train model.path="$model" \
    trainer.output_dir="$OUT/$name" trainer.overwrite=true trainer.total_steps=2 trainer.prompts_per_step=$(( 2 * nproc )) \
    rollout.n=4 rollout.sampling.sde_window_size=2 trainer.val_every=0 trainer.save_every=2 \
    reward.name=jpeg_compressibility logging.tensorboard=false logging.progress_bar=false "$@"
}

suite() {
  case $1 in
    tests) run tests 520 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests ;;
    qwen) bench qwen 520 rollout --model qwen-image -n 16 --steps 50 --size 512 --compile --repeats 2 \
            --modes pipeline-batched,engine-batched-compiled,engine-concurrent-compiled ;;
    sd35) bench sd35 400 rollout --model sd35-medium -n 16 --steps 10 --size 512 --compile --repeats 3 \
            --modes pipeline-batched,engine-batched-compiled,engine-concurrent-compiled ;;
    sd35-large) bench sd35-large 480 rollout --model sd35-large -n 16 --steps 10 --size 512 --guidance-scale 4.5 \
            --compile --modes pipeline-batched,engine-batched-compiled ;;
    flux) bench flux 480 rollout --model flux-dev -n 16 --steps 28 --size 512 --guidance-scale 3.5 --compile \
            --modes pipeline-batched,engine-batched-compiled ;;
    z-image) bench z-image 480 rollout --model z-image -n 16 --steps 50 --size 512 --guidance-scale 5.0 --compile \
            --modes pipeline-batched,engine-batched-compiled ;;
    wan) bench wan21-flowgrpo 300 rollout --model wan2.1-1.3b -n 8 --steps 20 --height 240 --width 416 --num-frames 33 \
            --guidance-scale 4.5 --compile --modes pipeline-batched,engine-batched-compiled ;;
    wan-480p) bench wan21-480p 540 rollout --model wan2.1-1.3b -n 4 --steps 20 --height 480 --width 832 --num-frames 81 \
            --guidance-scale 5.0 --compile --modes pipeline-batched,engine-batched-compiled ;;
    wan22-5b) bench wan22-5b 540 rollout --model wan2.2-5b -n 2 --steps 20 --height 704 --width 1280 --num-frames 121 \
            --guidance-scale 5.0 --compile --modes pipeline-batched,engine-batched-compiled ;;
    wan22-a14b) bench wan22-a14b 540 rollout --model wan2.2-a14b -n 2 --steps 20 --height 480 --width 832 --num-frames 33 \
            --guidance-scale 4.0 --compile --modes pipeline-batched,engine-batched-compiled ;;
    train-step-wan22-a14b) bench train-step-wan22-a14b 540 train --config recipes/wan21_1_3b_ocr_lora.yaml \
            model.path=random:wan2.2-a14b model.trained_expert=high 'rollout.sampling.sde_window=[0,13]' \
            $VIDEO_RUN reward.options.reward=jpeg_compressibility \
            trainer.prompts_per_step=2 ${OVERRIDES:-} --steps ${STEPS:-1} --peer-steps 0 ;;
    train-step-wan) bench train-step-wan 540 train --config recipes/wan21_1_3b_ocr_lora.yaml \
            model.path=random:wan2.1-1.3b $VIDEO_RUN reward.options.reward=jpeg_compressibility \
            trainer.prompts_per_step=2 ${OVERRIDES:-} $TIMING ;;
    train-step-wan22) bench train-step-wan22 540 train --config recipes/wan22_5b_dancegrpo_lora.yaml \
            model.path=random:wan2.2-5b $VIDEO_RUN reward.options.reward=jpeg_compressibility \
            trainer.prompts_per_step=2 ${OVERRIDES:-} --steps ${STEPS:-1} --peer-steps 0 ;;
    train-step-qwen) bench train-step-qwen 540 train --config recipes/qwen_image_ocr_lora.yaml \
            model.path=random:qwen-image $RANDOM_RUN trainer.prompts_per_step=2 ${OVERRIDES:-} $TIMING ;;
    train-step-qwen-nft) bench train-step-qwen-nft 540 train --config recipes/qwen_image_ocr_nft.yaml \
            model.path=random:qwen-image $RANDOM_RUN trainer.prompts_per_step=2 ${OVERRIDES:-} --steps ${STEPS:-2} --peer-steps 0 ;;
    train-step-sd35-nft) bench train-step-sd35-nft 420 train --config recipes/sd35_medium_ocr_nft.yaml \
            model.path=random:sd35-medium $RANDOM_RUN trainer.prompts_per_step=2 ${OVERRIDES:-} --steps ${STEPS:-2} --peer-steps 0 ;;
    train-step-sd35) bench train-step-sd35 540 train --config recipes/sd35_medium_ocr_lora.yaml \
            model.path=random:sd35-medium $RANDOM_RUN trainer.prompts_per_step=1 ${OVERRIDES:-} $TIMING ;;
    floors)
      run floors-qwen 240 python3 benchmarks/floor.py --model qwen-image -n 4 --guidance-scale 4.0 \
        --max-sequence-length 256 --lora-rank 64 --train --seconds 2 \
        --lora-targets to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out,img_mlp.net.0.proj,img_mlp.net.2,txt_mlp.net.0.proj,txt_mlp.net.2
      run floors-sd35 200 python3 benchmarks/floor.py --model sd35-medium -n 8 --guidance-scale 4.5 \
        --max-sequence-length 128 --lora-rank 32 --train --seconds 2 ;;
    dist-1gpu)
      local bf16="model.dtype=bfloat16 trainer.mixed_precision=bf16 rollout.sampling.height=512 rollout.sampling.width=512"
      dist dist-sd35-lora random:sd35-medium $bf16 trainer.lora.rank=32 trainer.micro_batch_size=4
      dist dist-sd35-full random:sd35-medium $bf16 trainer.lora.enabled=false trainer.micro_batch_size=4 trainer.lr=1e-5
      dist dist-qwen-lora random:qwen-image $bf16 trainer.lora.rank=64 trainer.micro_batch_size=2 \
        trainer.gradient_checkpointing=true ;;
    toy-make) run toy-make 590 python3 -m flowrl.cli make-toy outputs/toy-gpu --size gpu --seed 0 --device cuda ;;
    toy-learn) run toy-learn 590 python3 -m flowrl.cli bench learn --config recipes/toy_gpu_full.yaml --jobs 4 \
        --run 'full:' --run 'lora: trainer.lora.enabled=true trainer.lr=1e-3' \
        --steps 1000 --seconds 420 --eval-every 40 --out "$OUT/toy-learn" --overwrite ;;
    toy-algorithms)
      # recipes/toy_cpu_{nft,awm,dpo}.yaml's algorithm settings on the GPU-size recipe
      local fp="rollout.sampling.noise_level=0 rollout.sampling.logprobs=false algorithm.train_timestep_fraction=0.99"
      run toy-algorithms 590 python3 -m flowrl.cli bench learn --config recipes/toy_gpu_full.yaml --jobs 8 \
        --run 'flowgrpo:' \
        --run "nft: algorithm.name=diffusion_nft $fp algorithm.nft.beta=1.0 algorithm.nft.old_decay_flat=0 algorithm.nft.old_decay_rate=0.001 algorithm.nft.old_decay_max=0.5" \
        --run "awm: algorithm.name=awm $fp algorithm.std_mode=group algorithm.clip_range=1.0 algorithm.awm.weighting=ghuber algorithm.awm.ghuber_power=0.25 algorithm.awm.advantage_max=1.0 algorithm.awm.ema_kl_beta=1.0 algorithm.awm.ema_decay_rate=0.001 algorithm.awm.ema_decay_max=0.3" \
        --run "dpo: algorithm.name=online_dpo $fp algorithm.dpo.beta=100.0 algorithm.dpo.ref_update_every=10" \
        --steps 40 --eval-every 10 ${SEEDS:+trainer.seed=$SEEDS rollout.seed=$SEEDS} --out "$OUT/toy-algorithms${SEEDS:+-s$SEEDS}" --overwrite ;;
    toy-video-make) run toy-video-make 590 python3 -m flowrl.cli make-toy outputs/toy-video-gpu --size video-gpu \
        --seed 0 --device cuda ;;
    toy-video-algorithms)
      # recipes/toy_video_gpu_full.yaml (FlowGRPO) and recipes/toy_video_cpu_awm.yaml's AWM settings on it
      local fp="rollout.sampling.noise_level=0 rollout.sampling.logprobs=false algorithm.train_timestep_fraction=0.99"
      run toy-video-algorithms 590 python3 -m flowrl.cli bench learn --config recipes/toy_video_gpu_full.yaml --jobs 4 \
        --run 'flowgrpo:' \
        --run "awm: algorithm.name=awm $fp algorithm.std_mode=group algorithm.clip_range=1.0 algorithm.awm.weighting=ghuber algorithm.awm.ghuber_power=0.25 algorithm.awm.advantage_max=1.0 algorithm.awm.ema_kl_beta=1.0 algorithm.awm.ema_decay_rate=0.001 algorithm.awm.ema_decay_max=0.3" \
        --steps 50 --eval-every 25 --eval-seeds 32 trainer.seed=${SEEDS:-42} rollout.seed=${SEEDS:-42} \
        --out "$OUT/toy-video-algorithms-s${SEEDS:-42}" --overwrite ;;
    cpu-smoke)
      python3 -m flowrl.cli make-tiny --kind sd3 "$OUT/tiny-sd3" --overwrite >>"$LOG" 2>&1
      bench smoke-rollout 120 rollout --model tiny-sd3 -n 4 --steps 3 --size 64 --peak-seconds 0.05
      bench smoke-train 200 train --config recipes/sd35_medium_ocr_lora.yaml model.path=random:tiny-sd3 \
        model.dtype=float32 model.device=cpu engine.compile=false trainer.mixed_precision=no $RANDOM_RUN \
        trainer.prompts_per_step=1 rollout.n=2 rollout.sampling.height=64 rollout.sampling.width=64 \
        rollout.sampling.num_inference_steps=3 --steps 1 --peer-steps 1 --peak-seconds 0.05
      bench smoke-train-wan 200 train --config recipes/wan21_1_3b_ocr_lora.yaml model.path=random:tiny-wan \
        model.dtype=float32 model.device=cpu engine.compile=false trainer.mixed_precision=no $VIDEO_RUN \
        reward.options.reward=jpeg_compressibility trainer.prompts_per_step=1 rollout.n=2 rollout.sampling.height=32 \
        rollout.sampling.width=32 rollout.sampling.num_frames=5 rollout.sampling.num_inference_steps=3 \
        --steps 1 --peer-steps 1 --peak-seconds 0.05
      NPROC=2 GLOO_SOCKET_IFNAME=lo dist dist-cpu "$OUT/tiny-sd3" rollout.sampling.height=64 rollout.sampling.width=64 ;;
    *) echo "[gpu_suites] unknown suite $1 (see the header of benchmarks/gpu_suites.sh)" | tee -a "$LOG" ;;
  esac
}

for s in "$@"; do suite "$s"; done
grep -h "^\[bench\]\|^|\|img/s" "$LOG" | tail -n 60
