"""engine/train"""
