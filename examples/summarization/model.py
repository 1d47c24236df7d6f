"""A small transformer encoder-decoder with a pointer-generator copy mechanism.

At each target position the model mixes two distributions (See et al., 2017): generating a
token from the vocabulary, and copying a token of the article through a copy attention over
the encoder states. A learned gate ``p_gen`` weighs them:

    P(w) = p_gen * P_vocab(w) + (1 - p_gen) * sum of copy attention on source positions holding w

Copying is what lets a small model, trained for minutes, reproduce the article's rare terms
(drug, gene and disease names) in its summary. Source and target share one vocabulary and
one embedding matrix, which is also the output projection.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

EPS = 1e-9


def sinusoids(length: int, dim: int) -> Tensor:
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)
    return table


class PointerGenerator(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        *,
        d_model: int = 128,
        heads: int = 4,
        layers: int = 2,
        ff: int = 512,
        dropout: float = 0.1,
        max_len: int = 2048,
        pad_id: int = 0,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=pad_id)
        nn.init.normal_(self.embed.weight, std=d_model**-0.5)
        with torch.no_grad():
            self.embed.weight[pad_id].zero_()
        self.register_buffer("positions", sinusoids(max_len, d_model), persistent=False)
        self.dropout = nn.Dropout(dropout)

        def encoder_layer() -> nn.TransformerEncoderLayer:
            return nn.TransformerEncoderLayer(d_model, heads, ff, dropout, batch_first=True,
                                              norm_first=True)

        def decoder_layer() -> nn.TransformerDecoderLayer:
            return nn.TransformerDecoderLayer(d_model, heads, ff, dropout, batch_first=True,
                                              norm_first=True)

        self.encoder = nn.TransformerEncoder(encoder_layer(), layers,
                                             norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(decoder_layer(), layers, norm=nn.LayerNorm(d_model))
        self.copy_query = nn.Linear(d_model, d_model)
        self.copy_key = nn.Linear(d_model, d_model)
        self.gate = nn.Linear(3 * d_model, 1)
        self.out_bias = nn.Parameter(torch.zeros(vocab_size))

    def _embed(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) * math.sqrt(self.d_model) + self.positions[: ids.shape[1]]
        return self.dropout(x)

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        """Encoder states (B, S, d); `src_mask` is 1 on real tokens."""
        return self.encoder(self._embed(src), src_key_padding_mask=src_mask == 0)

    def decode(self, memory: Tensor, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Log-probabilities (B, T, V) of the next token at each target position."""
        y = self._embed(tgt_in)
        steps = tgt_in.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(steps, device=tgt_in.device)
        pad = src_mask == 0
        h = self.decoder(y, memory, tgt_mask=causal, tgt_is_causal=True,
                         memory_key_padding_mask=pad)
        vocab_logits = h @ self.embed.weight.t() + self.out_bias
        # copy attention over the source: (B, T, S)
        scores = self.copy_query(h) @ self.copy_key(memory).transpose(1, 2)
        scores = scores / math.sqrt(self.d_model)
        scores = scores.float().masked_fill(pad.unsqueeze(1), float("-inf"))
        attention = scores.softmax(dim=-1)
        context = attention.to(memory.dtype) @ memory
        p_gen = torch.sigmoid(self.gate(torch.cat([h, context, y], dim=-1)).float())
        probs = p_gen * vocab_logits.float().softmax(dim=-1)
        index = src.unsqueeze(1).expand(-1, steps, -1)
        probs = probs.scatter_add(2, index, (1 - p_gen) * attention)
        return torch.log(probs + EPS)

    def forward(self, src: Tensor, src_mask: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode(self.encode(src, src_mask), src, src_mask, tgt_in)

    @torch.no_grad()
    def generate(
        self,
        src: Tensor,
        src_mask: Tensor,
        *,
        bos_id: int,
        eos_id: int,
        max_len: int,
        banned: tuple[int, ...] = (),
        no_repeat_ngram: int = 3,
    ) -> list[list[int]]:
        """Greedy decoding; no n-gram of size `no_repeat_ngram` is produced twice."""
        memory = self.encode(src, src_mask)
        batch = src.shape[0]
        out = torch.full((batch, 1), bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(batch, dtype=torch.bool, device=src.device)
        for _ in range(max_len):
            logp = self.decode(memory, src, src_mask, out)[:, -1]
            if banned:
                logp[:, list(banned)] = float("-inf")
            if no_repeat_ngram > 1 and out.shape[1] >= no_repeat_ngram:
                self._block_repeats(out.tolist(), logp, no_repeat_ngram)
            token = logp.argmax(dim=-1)
            token = torch.where(done, torch.full_like(token, eos_id), token)
            out = torch.cat([out, token.unsqueeze(1)], dim=1)
            done |= token == eos_id
            if bool(done.all()):
                break
        summaries = []
        for row in out[:, 1:].tolist():
            summaries.append(row[: row.index(eos_id)] if eos_id in row else row)
        return summaries

    @staticmethod
    def _block_repeats(prefixes: list[list[int]], logp: Tensor, n: int) -> None:
        for row, prefix in enumerate(prefixes):
            context = tuple(prefix[len(prefix) - n + 1 :])
            seen = [
                prefix[i + n - 1]
                for i in range(len(prefix) - n + 1)
                if tuple(prefix[i : i + n - 1]) == context
            ]
            if seen:
                logp[row, seen] = float("-inf")
