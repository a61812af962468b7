"""Rows in, ``(input_ids, loss_mask)`` out: reading data sources, their row forms, the chat-template
loss mask and cached tokenizing, shared by extract, regen and eval."""
