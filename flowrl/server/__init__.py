"""HTTP services. `reward_app` serves a Reward over HTTP (the only place importing fastapi/uvicorn);
its client is `flowrl.rewards.http_client.HttpReward`."""
