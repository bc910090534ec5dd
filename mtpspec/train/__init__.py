"""Training: `pretrain` (a hybrid model with the DeepSeek-V3 next-token + MTP objective) and `head`
(an MTP / Medusa / EAGLE draft head fitted to a frozen target's own generations)."""
