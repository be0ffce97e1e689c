"""The toy world's supervised ceiling: flow-matching fine-tuning of the committed CPU model on exact
renders of the RL prompts' captions (the answer an RL run could at best converge to), then saved
for `flowrl eval --transformer` on the held-out prompts. It bounds what any algorithm's RL on
those prompts can carry over to the held-out ones within the same steps, batch and learning rate
(benchmarks/results/2026-12-05_algorithms_toy-cpu.md).

    python benchmarks/toy_sft_ceiling.py --lr 5e-5 --steps 60 --batch 64 --out outputs/sft
    flowrl eval --config recipes/toy_cpu_full.yaml --prompts flowrl/data/toy_prompts/val.jsonl \
        --transformer outputs/sft --out outputs/sft-eval
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="folder for the fine-tuned transformer")
    args = parser.parse_args()

    from diffusers import StableDiffusion3Pipeline

    from flowrl.data.toy_render import render_caption
    from flowrl.data.toy_world import parse_caption
    from flowrl.models.debug.toy import committed_checkpoint
    from flowrl.models.debug.toy_pretrain import encode_captions, encode_pictures, sample_sigmas

    torch.set_num_threads(1)
    pipeline = StableDiffusion3Pipeline.from_pretrained(str(committed_checkpoint()))
    with open("flowrl/data/toy_prompts/train.jsonl") as f:
        captions = [json.loads(line)["prompt"] for line in f]
    text = encode_captions(pipeline, captions, "cpu")
    generator = torch.Generator().manual_seed(args.seed)
    transformer = pipeline.transformer.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=args.lr, weight_decay=1e-4)
    for step in range(args.steps):
        rows = torch.randint(len(captions), (args.batch,), generator=generator).tolist()
        pictures = torch.stack(
            [
                torch.from_numpy(render_caption(parse_caption(captions[i]), seed=step * 1000 + i)).permute(2, 0, 1)
                for i in rows
            ]
        )
        with torch.no_grad():
            x0 = encode_pictures(pipeline.vae, pictures, "cpu")
        noise = torch.randn(x0.shape, generator=generator)
        sigma = sample_sigmas(args.batch, generator).view(-1, 1, 1, 1)
        prediction = transformer(
            hidden_states=(1 - sigma) * x0 + sigma * noise,
            timestep=sigma.view(-1) * 1000,
            encoder_hidden_states=torch.stack([text[captions[i]]["encoder_hidden_states"] for i in rows]),
            pooled_projections=torch.stack([text[captions[i]]["pooled_projections"] for i in rows]),
            return_dict=False,
        )[0]
        loss = (prediction - (noise - x0)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0:
            print(f"step {step}: flow-matching loss {loss.item():.4f}", flush=True)
    transformer.eval().save_pretrained(args.out)


if __name__ == "__main__":
    main()
