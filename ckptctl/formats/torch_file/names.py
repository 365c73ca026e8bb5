"""The name a full checkpoint of one ``torch.save`` state dict has in a directory."""

STATE_DICT_FILE = "state_dict.pt"
