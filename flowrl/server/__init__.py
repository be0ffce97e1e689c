"""HTTP services, the only package that imports the web framework (fastapi, uvicorn).

- `reward_app`: a Reward served over HTTP (`flowrl reward-server`); its client is
  `flowrl.rewards.http_client.HttpReward`.
- `rollout_app`: the engine served over HTTP (`flowrl serve`): the OpenAI Images API, RL rollouts,
  weight updates, metrics. `wire` is its wire format, shared with the client (`flowrl.client`);
  it imports no web framework.
"""
