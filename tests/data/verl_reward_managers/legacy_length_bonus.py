"""A custom reward manager in verl's older API (AbstractRewardManager.__call__ over the batch), as users write them:
the scorer's score plus `bonus` per response token, spread over the response's tokens (a token-level reward)."""

from collections import defaultdict

import torch

from verl import DataProto
from verl.workers.reward_manager import register
from verl.workers.reward_manager.abstract import AbstractRewardManager


@register("length_bonus")
class LengthBonusManager(AbstractRewardManager):
    def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source", bonus=0.0):
        self.tokenizer, self.compute_score, self.key, self.bonus = tokenizer, compute_score, reward_fn_key, bonus

    def __call__(self, data: DataProto, return_dict: bool = False):
        reward_tensor = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        info = defaultdict(list)
        for i in range(len(data)):
            item = data[i]
            prompt_length = item.batch["prompts"].shape[-1]
            valid = int(item.batch["attention_mask"][prompt_length:].sum())
            text = self.tokenizer.decode(item.batch["responses"][:valid], skip_special_tokens=True)
            result = self.compute_score(item.non_tensor_batch[self.key], text,
                                        item.non_tensor_batch["reward_model"]["ground_truth"],
                                        item.non_tensor_batch.get("extra_info", {}))
            score = result["score"] if isinstance(result, dict) else result
            reward_tensor[i, :valid] = self.bonus
            reward_tensor[i, valid - 1] += score
            info["base"].append(score)
        return {"reward_tensor": reward_tensor, "reward_extra_info": info} if return_dict else reward_tensor
