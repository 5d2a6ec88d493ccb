"""Synthetic, seeded workload: prompts of random word counts, random output lengths, and
Poisson send times."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Plain words for synthetic prompts; a random draw from them rarely shares long prefixes, so
# prefix caching does little across requests.
WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book
eye job word business issue side kind head house service friend father power hour game line
end member law car city community name president team minute idea kid body information back
parent face others level office door health person art war history party result change
morning reason research girl guy moment air teacher force education river stone garden window
light bridge market letter paper music table voice field road village winter summer autumn
spring ocean mountain forest island engine signal measure quiet bright simple careful green
yellow silver early later always never often rarely slowly quickly under over between across
before after during while because although however therefore perhaps certainly build carry
draw drive find follow give hold keep learn leave listen move open play read run speak stand
start stay take talk think travel turn wait walk watch write answer bring choose clean close
""".split()


@dataclass
class WorkItem:
    prompt: str
    max_tokens: int


def make_workload(n: int, seed: int, input_len: tuple[int, int], output_len: tuple[int, int]) -> list[WorkItem]:
    """n prompts of random word counts in input_len and random max_tokens in output_len."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        words = rng.randint(*input_len)
        items.append(WorkItem(" ".join(rng.choice(WORDS) for _ in range(words)), rng.randint(*output_len)))
    return items


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of n requests: the first at 0, then exponential gaps of mean 1/rate."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def exact_token_prompts(tokenizer, n: int, n_tokens: int, seed: int, max_tries: int = 50) -> list[str]:
    """n text prompts of plain words that encode to exactly n_tokens tokens (special tokens
    included, as the server and the engine encode a prompt), so an HTTP run and an offline
    run of the same texts see the same token ids."""
    specials = len(tokenizer.encode("", add_special_tokens=True))
    if n_tokens <= specials:
        raise ValueError(f"n_tokens must be > {specials} (the tokenizer's special tokens), got {n_tokens}")
    rng = random.Random(f"exact-{seed}")
    prompts = []
    for _ in range(n):
        for _ in range(max_tries):
            # Every word is at least one token, so this many words always suffice.
            words = " ".join(rng.choice(WORDS) for _ in range(n_tokens))
            ids = tokenizer.encode(words, add_special_tokens=False)[: n_tokens - specials]
            text = tokenizer.decode(ids)
            if len(tokenizer.encode(text, add_special_tokens=True)) == n_tokens:
                prompts.append(text)
                break
        else:
            raise ValueError(f"no prompt of exactly {n_tokens} tokens in {max_tries} tries "
                             f"(this tokenizer does not round-trip truncated text)")
    return prompts
