"""Native model code: nn.Modules only, no tokenizer inside."""
